"""Replication's rule (issue 39, item 5): a write no replica had within ``WAIT`` is not done.

On one embedded redis-server with no replica, a ``WAIT`` for one replica always times out: every
write is unconfirmed, as on a primary cut off from its replicas. The partition itself, on a real
Sentinel cluster, is tests/test_sentinel_partition.py.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context
from celery.exceptions import Reject

from tasks.core import keys, transport
from tasks.core.app import FleetCelery, create_app
from tasks.core.devices import format_core_list
from tasks.core.jobstate import JobEnd, MessageAck, Stored, hand_over
from tasks.core.sentinel import Replication
from tasks.core.settings import Settings
from tasks.ops.redis_server import EmbeddedRedis
from tasks.worker import fence, lease
from tasks.worker.admission import of_lease
from tasks.worker.disposition import apply
from tasks.worker.lease import LeaseKeeper, Take

pytestmark = pytest.mark.timeout(60)

#: A WAIT for a replica that is not there gives up after this: short, the test waits it out.
WAIT_MS = 20
UNCONFIRMED = Replication(replicas=1, timeout_ms=WAIT_MS)


class NoRoundTrip:
    """A client any command of which fails the test."""

    def execute_command(self, *args: Any) -> Any:
        raise AssertionError(f"a round trip: {args}")


def test_with_no_replica_asked_for_every_write_is_done_without_a_round_trip(client):
    assert Replication().wait(NoRoundTrip(), "a write") is True
    client.set("x", 1)
    assert UNCONFIRMED.wait(client, "a write") is False


def test_a_lease_no_replica_confirmed_is_no_lease(client):
    """The take is released and the job not held; its task is rejected back to its queue."""
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s=5.0, replication=UNCONFIRMED)
    task_id = str(uuid.uuid4())
    taken = keeper.take(task_id, "tag-1")
    assert taken.outcome is Take.UNCONFIRMED and taken.attempt is None
    assert keeper.held() == [] and keeper.must_stop(task_id) is None
    assert client.exists(keys.lease(task_id)) == 0 and not client.hexists(keys.LEASES, task_id)

    task = SimpleNamespace(request=Context(id=str(uuid.uuid4()), properties={"delivery_tag": "tag-2"}),
                           name="devicefleet.tick", backend=None, app=SimpleNamespace(conf=SimpleNamespace(result_expires=0)))
    held = keeper.hold(task)
    assert held.outcome is Take.UNCONFIRMED and held.attempt is None  # the job does not run
    refused = of_lease(SimpleNamespace(service=None), "j", held)
    with pytest.raises(Reject) as rejected:
        apply(refused, SimpleNamespace(task=task, worker=SimpleNamespace(leases=keeper)), ran=False)
    assert rejected.value.requeue is True
    assert keeper.held() == []


def test_a_renewal_no_replica_confirmed_does_not_put_the_jobs_stop_off(client, monkeypatch):
    """The primary renews the lease, but no replica has the renewal: the job is to be stopped
    fence_after_s after the take (the last write a replica had), though the lease lives on the
    primary; the same renewal confirmed puts the stop off. On the keepers' clock, set by hand."""
    now = [1000.0]
    clock = SimpleNamespace(monotonic=lambda: now[0], time=time.time)
    monkeypatch.setattr(lease, "time", clock)  # the take's and the renewals' send times
    monkeypatch.setattr(fence, "time", clock)  # the fence's reading of them
    ttl_s = 4.0
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s, replication=UNCONFIRMED)
    control = LeaseKeeper(client, "cpu1", "cpu1@here", ttl_s)
    task_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    keeper._writes._replication = Replication()  # the take confirmed; from here on, cut off from the replicas
    assert keeper.take(task_id, None).outcome is Take.TAKEN
    keeper._writes._replication = UNCONFIRMED
    assert control.take(other, None).outcome is Take.TAKEN
    now[0] += ttl_s / 3  # a beat: both renew
    keeper.tick()
    control.tick()
    assert client.pttl(keys.lease(task_id)) > ttl_s * 1000 * 0.9  # renewed on the primary
    now[0] += keeper.fence_after_s - ttl_s / 3  # fence_after_s after the take
    why = keeper.must_stop(task_id)
    assert why is not None and "has not confirmed its lease" in why
    assert control.must_stop(other) is None  # confirmed a beat ago
    keeper.release(task_id)
    control.release(other)


@pytest.fixture(scope="module")
def app(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetCelery]:
    settings = Settings.load(redis_url=redis_server.url, state_dir=tmp_path_factory.mktemp("unconfirmed-state"),
                             cores=format_core_list(sorted(os.sched_getaffinity(0))),
                             redis_wait_replicas=1, redis_wait_timeout_ms=WAIT_MS)
    celery_app = create_app(settings, main="devicefleet-unconfirmed")
    yield celery_app
    celery_app.close()


@pytest.mark.parametrize("acked_by_script", [True, False])
def test_a_store_no_replica_confirmed_is_not_acknowledged_anywhere_else(client, app, acked_by_script):
    """The store ran (its lease released with it, on this primary), the hand-over says it is not
    confirmed, and the channel's acknowledgement that follows is bookkeeping only: no HDEL that
    could reach a promoted replica, whose copy of the message is how the job runs again."""
    keeper = LeaseKeeper(client, "cpu3", "cpu3@here", ttl_s=5.0)
    task_id, tag = str(uuid.uuid4()), f"tag-{uuid.uuid4()}"
    assert keeper.take(task_id, tag).outcome is Take.TAKEN
    request = Context(id=task_id, properties={"delivery_tag": tag})
    names = transport.stored_ack_keys(app.conf)
    assert names is not None
    ack = MessageAck(unacked_key=names[0], unacked_index_key=names[1], delivery_tag=tag) if acked_by_script else None
    end = JobEnd(attempt=keeper.finishing(task_id), ack=ack)
    handed = hand_over(request, end)
    app.backend.store_result(task_id, {"done": True}, "SUCCESS", request=request)
    assert handed.stored is Stored.STORED and handed.confirmed is False
    assert transport._take_mark(tag) is True  # the channel's ack: kombu's bookkeeping, no round trip
    keeper.settle(task_id, request)
    assert keeper.held() == []

