"""Priorities on the session fleet: a free device takes the highest level first, whatever was
queued before it and whatever the worker had prefetched (tasks.core.priority)."""

from __future__ import annotations

import pytest

from tasks import fan_out
from tasks.core.errors import ConfigError

from .conftest import wait_for

#: Batch jobs queued behind a running job before the urgent one (the issue's figure).
QUEUED_BATCH = 100


@pytest.mark.timeout(180)
def test_an_urgent_job_starts_before_a_hundred_batch_jobs_queued_first(fleet, app, tmp_path):
    release, order = tmp_path / "release", tmp_path / "order"
    # cpu0 busy: everything below waits in Redis, and the worker holds no other message.
    hold = fan_out("hold", ["cpu0"], kwargs={"steps": 1, "release_file": str(release)}, app=app)
    wait_for(lambda: hold.progress()["cpu0"].get("step") == 1, 60, "the hold job running on cpu0")
    batch = [fan_out("stamp", ["cpu0"], kwargs={"path": str(order), "label": f"batch-{i}"}, priority="batch",
                     user="bob", app=app) for i in range(QUEUED_BATCH)]
    urgent = fan_out("stamp", ["cpu0"], kwargs={"path": str(order), "label": "urgent"}, priority="urgent",
                     user="alice", app=app)
    release.touch()
    assert urgent.get(timeout=60)["cpu0"]["status"] == "ok"
    for handle in batch:
        assert handle.get(timeout=120)["cpu0"]["status"] == "ok"
    hold.get(timeout=30)
    # The urgent job was the next to start, then the batch jobs in the order they were sent.
    assert order.read_text().split() == ["urgent"] + [f"batch-{i}" for i in range(QUEUED_BATCH)]


def test_a_bad_level_or_user_is_refused_before_anything_is_sent(fleet, app):
    with pytest.raises(ConfigError, match=r"priority 'asap' is not a level: use one of urgent, normal, batch"):
        fan_out("noop", ["cpu0"], priority="asap", app=app)
    with pytest.raises(ConfigError, match=r"user 'a b' is not a user name"):
        fan_out("noop", ["cpu0"], user="a b", app=app)
