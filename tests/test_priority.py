"""Priorities on the session fleet: a free device takes the highest level first, whatever was
queued before it and whatever the worker had prefetched (tasks.core.priority); a busy one is
preempted (tasks.worker.preemption)."""

from __future__ import annotations

import pytest
from rich.console import Console

from tasks import fan_out, sweep
from tasks.core import keys
from tasks.core.errors import ConfigError
from tasks.core.registry import connect

from .conftest import wait_for

#: Batch jobs queued behind a running job before the urgent one (the issue's figure).
QUEUED_BATCH = 100
#: A job that holds its device while a test looks at what waits behind it: never preempted.
NOT_PREEMPTED = {"preemptible": False}


def _hold_cpu0(app, release):  # type: ignore[no-untyped-def]
    """cpu0 busy with a job that is never preempted, until ``release`` exists: what is sent to
    cpu0 meanwhile waits in Redis, and its worker holds no other message."""
    hold = fan_out("hold", ["cpu0"], kwargs={"steps": 1, "release_file": str(release)},
                   options=NOT_PREEMPTED, app=app)
    wait_for(lambda: hold.progress()["cpu0"].get("step") == 1, 60, "the hold job running on cpu0")
    return hold


@pytest.mark.timeout(180)
def test_an_urgent_job_starts_before_a_hundred_batch_jobs_queued_first(fleet, app, tmp_path):
    release, order = tmp_path / "release", tmp_path / "order"
    hold = _hold_cpu0(app, release)
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


@pytest.mark.timeout(120)
def test_a_batch_sweeps_own_queue_yields_to_an_urgent_job_and_keeps_its_trial_order(fleet, app, tmp_path):
    release, order = tmp_path / "release", tmp_path / "order"
    hold = _hold_cpu0(app, release)
    # One device of two: the sweep's own queue, whose batch list cpu0 is asked to consume.
    trials = sweep("stamp", [{"label": f"s{i}"} for i in range(3)], devices="cpu0", kwargs={"path": str(order)},
                   priority="batch", user="bob", app=app)
    assert trials.queue.list == f"sweep.{trials.id}:batch"
    urgent = fan_out("stamp", ["cpu0"], kwargs={"path": str(order), "label": "u"}, priority="urgent", app=app)
    release.touch()
    assert [entry["status"] for entry in trials.get(timeout=60)] == ["ok"] * 3
    assert urgent.get(timeout=60)["cpu0"]["status"] == "ok"
    hold.get(timeout=30)
    assert order.read_text().split() == ["u", "s0", "s1", "s2"]


def test_a_bad_level_or_user_is_refused_before_anything_is_sent(fleet, app):
    with pytest.raises(ConfigError, match=r"priority 'asap' is not a level: use one of urgent, normal, batch"):
        fan_out("noop", ["cpu0"], priority="asap", app=app)
    with pytest.raises(ConfigError, match=r"user 'a b' is not a user name"):
        fan_out("noop", ["cpu0"], user="a b", app=app)


@pytest.mark.timeout(120)
def test_status_shows_waiting_work_by_level_and_user_with_position_and_reason(fleet, app, tmp_path):
    from tasks import waiting
    from tasks.ops.status import render, report

    release, order = tmp_path / "release", tmp_path / "order"
    hold = fan_out("hold", ["cpu1"], kwargs={"steps": 1, "release_file": str(release)}, user="carol",
                   options=NOT_PREEMPTED, app=app)
    wait_for(lambda: hold.progress()["cpu1"].get("step") == 1, 60, "the hold job running on cpu1")
    # The registry says what cpu1 runs once its heartbeat wrote the busy slot.
    wait_for(lambda: any(slot["busy"] for slot in report(fleet.redis_url)["workers"]["cpu1"]["slots"]),
             30, "cpu1's record showing its running job")
    batch = [fan_out("stamp", ["cpu1"], kwargs={"path": str(order), "label": f"b{i}"}, priority="batch", user="bob",
                     app=app) for i in range(2)]
    urgent = fan_out("stamp", ["cpu1"], kwargs={"path": str(order), "label": "u"}, priority="urgent", user="alice",
                     app=app)
    try:
        jobs = [job for job in waiting(app=app) if job.devices == ["cpu1"]]
        assert [(job.level.value, job.user, job.job, job.position) for job in jobs] == [
            ("urgent", "alice", "stamp", 1), ("batch", "bob", "stamp", 2), ("batch", "bob", "stamp", 3)]
        assert [job.queue for job in jobs] == ["device.cpu1:urgent", "device.cpu1:batch", "device.cpu1:batch"]
        assert jobs[0].job_id == urgent.task_ids["cpu1"]
        assert "busy (cpu1: hold (normal, carol))" in jobs[0].reason
        assert jobs[2].reason.startswith("2 jobs ahead of it (1 urgent, 1 batch)")
        rep = report(fleet.redis_url)
        assert rep["waiting_by_level"] == {"urgent": {"alice": 1}, "batch": {"bob": 2}}
        assert [job["position"] for job in rep["waiting"] if job["devices"] == ["cpu1"]] == [1, 2, 3]
        console = Console(record=True, width=200)
        console.print(render(rep))
        text = console.export_text()
        assert "waiting (urgent: alice 1; batch: bob 2)" in text
        assert "device.cpu1:urgent" in text
    finally:
        release.touch()
    assert urgent.get(timeout=60)["cpu1"]["status"] == "ok"
    assert all(handle.get(timeout=60)["cpu1"]["status"] == "ok" for handle in batch)
    hold.get(timeout=30)
    assert order.read_text().split() == ["u", "b0", "b1"]


def test_a_worker_takes_every_urgent_list_first_and_the_queues_of_a_level_in_turns():
    from tasks.core.devices import Device, DeviceKind
    from tasks.core.priority import Level
    from tasks.core.queue_lists import leveled, split_level
    from tasks.core.queues import worker_queues
    from tasks.core.transport import LevelCycle

    queues = leveled(worker_queues(Device(kind=DeviceKind.CPU, index=0)))
    assert queues == ["device.cpu0:urgent", "cpu:urgent", "fleet:urgent", "device.cpu0", "cpu", "fleet",
                      "device.cpu0:batch", "cpu:batch", "fleet:batch"]
    cycle = LevelCycle()
    cycle.update([*queues, "sweep.s1:urgent", "sweep.s2"])  # as kombu hands it after add_consumer
    assert cycle.consume(11) == ["device.cpu0:urgent", "cpu:urgent", "fleet:urgent", "sweep.s1:urgent",
                                 "device.cpu0", "cpu", "fleet", "sweep.s2", "device.cpu0:batch", "cpu:batch",
                                 "fleet:batch"]
    # The list just used goes last among its level's (kombu's round robin, within a level only).
    cycle.rotate("device.cpu0:urgent")
    cycle.rotate("cpu")
    assert cycle.consume(11) == ["cpu:urgent", "fleet:urgent", "sweep.s1:urgent", "device.cpu0:urgent",
                                 "device.cpu0", "fleet", "sweep.s2", "cpu", "device.cpu0:batch", "cpu:batch",
                                 "fleet:batch"]
    # A host-qualified device whose host is named like a level is still a normal queue.
    assert split_level("device.cpu0@batch") == ("device.cpu0@batch", Level.NORMAL)


@pytest.mark.timeout(120)
def test_an_urgent_job_preempts_a_batch_job_which_resumes_from_its_checkpoint(fleet, app, tmp_path):
    from tasks.ops.exporter import fleet_snapshot

    release, events = tmp_path / "release", tmp_path / "events"
    client = connect(fleet.redis_url)
    preempted_before = fleet_snapshot(client)["devices"]["cpu0"]["jobs_preempted"]
    batch = fan_out("resumable", ["cpu0"], kwargs={"path": str(events), "label": "batch", "steps": 6, "hold_at": 3,
                                                   "release_file": str(release)}, priority="batch", app=app)
    try:
        # Holding at step 3 until released: it cannot end before the urgent job preempts it.
        wait_for(lambda: batch.progress()["cpu0"].get("step") == 3, 60, "the batch job running on cpu0")
        urgent = fan_out("stamp", ["cpu0"], kwargs={"path": str(events), "label": "urgent"}, priority="urgent",
                         app=app)
        assert urgent.get(timeout=60)["cpu0"]["status"] == "ok"
    finally:
        release.touch()
    entry = batch.get(timeout=60)["cpu0"]
    assert entry["status"] == "ok"
    assert entry["preemptions"] == 1
    assert entry["output"] == {"step": 6, "attempt": 2}
    # It checkpointed when told and stopped at ctx.progress() (within its grace: not ended); the
    # urgent job started once it had stopped, and it ran again from its checkpoint, never twice at once.
    assert events.read_text().splitlines() == [
        "batch start 1 0", "batch preempted 3", "urgent", "batch start 2 3", "batch done 6"]
    try:
        task_id = batch.task_ids["cpu0"]
        assert client.llen(keys.worker_deaths(task_id)) == 0
        assert not client.hexists(keys.DEAD_LETTERS, task_id)
        # Counted where Prometheus reads it (devicefleet_preemptions_total).
        assert fleet_snapshot(client)["devices"]["cpu0"]["jobs_preempted"] == preempted_before + 1
    finally:
        client.close()


#: A command that checkpoints on SIGTERM (its first run) and resumes from it (the next).
RESUMABLE_SCRIPT = """
echo "command start $DEVICEFLEET_ATTEMPT" >> "$EVENTS"
if [ ! -f "$DEVICEFLEET_ARTIFACTS_DIR/checkpoint" ]; then
  trap 'echo 7 > "$DEVICEFLEET_ARTIFACTS_DIR/checkpoint"; echo "command term" >> "$EVENTS"; exit 0' TERM
  while true; do sleep 0.05; done
fi
echo "command done $(cat "$DEVICEFLEET_ARTIFACTS_DIR/checkpoint")" >> "$EVENTS"
"""


@pytest.mark.timeout(120)
def test_a_preempted_command_gets_sigterm_and_runs_again_with_its_attempt_and_artifacts(fleet, app, tmp_path):
    import tasks

    events = tmp_path / "events"
    batch = fan_out(tasks.command(["bash", "-c", RESUMABLE_SCRIPT], env={"EVENTS": str(events)}), ["cpu1"],
                    priority="batch", app=app)
    wait_for(lambda: events.exists() and events.read_text() == "command start 1\n", 60,
             "the batch command running on cpu1")
    urgent = fan_out("stamp", ["cpu1"], kwargs={"path": str(events), "label": "urgent"}, priority="urgent", app=app)
    assert urgent.get(timeout=60)["cpu1"]["status"] == "ok"
    entry = batch.get(timeout=60)["cpu1"]
    assert entry["status"] == "ok"
    assert entry["preemptions"] == 1
    assert events.read_text().splitlines() == [
        "command start 1", "command term", "urgent", "command start 2", "command done 7"]


def test_one_job_makes_way_per_higher_level_message_waiting_and_only_after_its_minimum_run(fleet):
    import time

    from tasks.core.priority import Level
    from tasks.core.queue_lists import leveled
    from tasks.worker.preemption import Preemption

    client = connect(fleet.redis_url)
    queue = "preemption-unit"  # a queue no worker consumes
    try:
        # Two slots, both running batch jobs; one urgent message waits.
        watch = Preemption(client, lambda: leveled([queue]), slots=2, min_run_s=30.0)
        now = time.monotonic()
        watch.running("a", Level.BATCH)
        watch.running("b", Level.BATCH)
        watch.tick()
        assert watch.claim("a", Level.BATCH, now) is None  # run less than min_run_s
        client.lpush(f"{queue}:urgent", "m1")
        watch.tick()
        long_ago = now - 60.0
        assert watch.claim("a", Level.BATCH, long_ago) is Level.URGENT
        assert watch.claim("b", Level.BATCH, long_ago) is None  # one message: one job makes way
        assert watch.claim("c", Level.URGENT, long_ago) is None  # nothing waits above urgent
        # A job that starts makes the last look stale: nothing is preempted until the next one.
        watch.done("a")
        watch.running("d", Level.BATCH)
        assert watch.claim("d", Level.BATCH, long_ago) is None
        watch.tick()
        assert watch.claim("d", Level.BATCH, long_ago) is Level.URGENT
    finally:
        client.delete(f"{queue}:urgent", keys.preempt_claims(f"{queue}:urgent"))
        client.close()
