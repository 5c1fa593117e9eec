"""Fencing (issue 39 items 1-3) on a real redis-server: the token each take issues, the scripts'
refusal of an older one, the self-fencing of a lease keeper whose renewals fail, and the report
of a self-fenced job that takes its death back. The partition itself, on real hosts, is
tests/test_partition.py."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from tasks.core import keys
from tasks.core.jobcount import DeviceStats, JobCount
from tasks.core.jobstate import JobEnd, JobState, MessageAck, StateMeta, Stored, Took
from tasks.core.records import LeaseRecord
from tasks.core.registry import connect
from tasks.ops.exporter import fleet_snapshot
from tasks.worker.lease import LeaseKeeper, death_note

from .conftest import wait_for

pytestmark = pytest.mark.timeout(60)


def _record(task_id: str, device: str = "cpu0", pid: int | None = None) -> LeaseRecord:
    return LeaseRecord(device=device, worker=f"{device}@here", pid=pid or os.getpid(), host="here",
                       task_id=task_id, since=1.0)


def _started(task_id: str) -> StateMeta:
    # As tasks.worker.lease.started_meta leaves it: the token first in the result, unstamped.
    meta = {"status": "STARTED", "result": {"token": None, "pid": 1, "hostname": "h"}, "task_id": task_id,
            "kwargs": {"token": None}}
    return StateMeta(key=f"celery-task-meta-{task_id}", value=json.dumps(meta), expires_s=0)


def test_each_take_issues_a_larger_token_carried_by_the_lease_and_the_started_state(client):
    jobs = JobState(client)
    task_id = str(uuid.uuid4())
    first = jobs.take(_record(task_id), 5000, started=_started(task_id))
    assert first.status is Took.OK and first.attempt is not None and first.attempt.token == 1
    lease = LeaseRecord.model_validate_json(client.get(keys.lease(task_id)))
    assert lease.token == 1 and client.get(keys.lease(task_id)) == first.attempt.lease
    assert LeaseRecord.model_validate_json(client.hget(keys.LEASES, task_id)).token == 1
    started = json.loads(client.get(f"celery-task-meta-{task_id}"))
    # Only the token's own place is stamped: a user's kwarg of that name is left alone.
    assert started["result"]["token"] == 1 and started["kwargs"] == {"token": None}

    jobs.release(first.attempt)
    second = jobs.take(_record(task_id, device="cpu1"), 5000, started=_started(task_id))
    assert second.attempt is not None and second.attempt.token == 2
    assert json.loads(client.get(f"celery-task-meta-{task_id}"))["result"]["token"] == 2
    assert int(client.get(keys.fence(task_id))) == 2


def test_every_write_of_an_older_attempt_is_refused_and_counted(client):
    jobs = JobState(client)
    task_id = str(uuid.uuid4())
    stale = jobs.take(_record(task_id), 5000).attempt
    assert stale is not None
    client.delete(keys.lease(task_id))  # its lease expired and was given back meanwhile
    client.hdel(keys.LEASES, task_id)
    current = jobs.take(_record(task_id, device="cpu1"), 5000).attempt
    assert current is not None and current.token > stale.token

    # Renew (even to restore a lost lease) and release leave the newer attempt's lease alone.
    assert not jobs.renew(stale, 5000, restore=True)
    assert not jobs.release(stale)
    assert client.get(keys.lease(task_id)) == current.lease
    # The late store of the older attempt is refused: nothing stored, released or acknowledged,
    # and the device counts the refusal where the exporter reads it.
    client.hset("unacked", "tag-1", "message")
    meta = StateMeta(key=f"celery-task-meta-{task_id}", value=json.dumps({"status": "SUCCESS", "result": "stale"}),
                     expires_s=0)
    count = JobCount(device="cpu0", ok=True, worker="cpu0@here", busy_seconds=1.0, last_finished_at=5.0)
    ack = MessageAck(unacked_key="unacked", unacked_index_key="unacked_index", delivery_tag="tag-1")
    assert jobs.finish(task_id, meta, JobEnd(attempt=stale, count=count, ack=ack), final=True) is Stored.FENCED
    assert client.get(meta.key) is None and client.get(keys.lease(task_id)) == current.lease
    assert client.hexists("unacked", "tag-1")
    stats = DeviceStats.parse(client.hgetall(keys.stats("cpu0")))
    assert stats.writes_refused == 1 and stats.jobs_total == 0
    assert fleet_snapshot(client)["devices"]["cpu0"]["writes_refused"] == 1

    # The lease-holding attempt's store is the one stored.
    ours = StateMeta(key=meta.key, value=json.dumps({"status": "SUCCESS", "result": "current"}), expires_s=0)
    assert jobs.finish(task_id, ours, JobEnd(attempt=current), final=True) is Stored.STORED
    assert json.loads(client.get(meta.key))["result"] == "current"
    assert client.exists(keys.lease(task_id)) == 0


def test_a_self_fenced_worker_counts_no_death_whoever_sees_its_lease_first(client):
    jobs = JobState(client)
    note = death_note(_record("x", pid=4242))
    # The reaper saw the cut-off worker dead first and counted its death; the worker's report
    # after the heal takes it back and counts the stop on its device.
    reaped = str(uuid.uuid4())
    raw = jobs.take(_record(reaped, pid=4242), 5000).attempt.lease
    assert jobs.reaped(reaped, raw, note, 0)
    assert client.lrange(keys.worker_deaths(reaped), 0, -1) == [note]
    assert jobs.fenced(reaped, "cpu0", note, 0) == 1
    assert client.lrange(keys.worker_deaths(reaped), 0, -1) == []
    assert DeviceStats.parse(client.hgetall(keys.stats("cpu0"))).jobs_fenced == 1
    # Reported first: neither the reaper nor a worker taking the lease over counts it.
    for path in ("reaper", "take"):
        task_id = str(uuid.uuid4())
        attempt = jobs.take(_record(task_id, pid=4242), 5000).attempt
        assert attempt is not None
        jobs.fenced(task_id, "cpu0", note, 0)
        if path == "reaper":
            assert jobs.reaped(task_id, attempt.lease, note, 0)
        else:
            taken = jobs.take(_record(task_id, device="cpu1"), 5000, replace=attempt.lease, dead=note)
            assert taken.status is Took.OK
        assert client.llen(keys.worker_deaths(task_id)) == 0, path
    # A crash is still a death.
    crashed = str(uuid.uuid4())
    raw = jobs.take(_record(crashed, pid=4343), 5000).attempt.lease
    assert jobs.reaped(crashed, raw, death_note(_record(crashed, pid=4343)), 0)
    assert client.llen(keys.worker_deaths(crashed)) == 1


def test_a_keeper_whose_renewals_fail_stops_its_job_before_the_lease_can_expire(redis_server, client):
    """Redis paused (SIGSTOP: the keeper's renewals hang, as when its worker is cut off): the
    keeper says to stop the job once its lease has gone unconfirmed for fence_after_s, before
    the lease's TTL runs out; it never renews or restores that lease again, and its report after
    Redis is back counts the stop."""
    ttl_s = 1.5
    keeper_client = connect(redis_server.url)
    keeper = LeaseKeeper(keeper_client, "cpu0", "cpu0@here", ttl_s)
    assert keeper.fence_after_s < ttl_s and keeper.fence_after_s + keeper.fence_grace_s < ttl_s
    task_id = str(uuid.uuid4())
    assert keeper.take(task_id, None).attempt is not None
    keeper.start()
    process = redis_server.process
    assert process is not None
    try:
        wait_for(lambda: client.pttl(keys.lease(task_id)) > ttl_s * 1000 * 0.9, 10, "a renewal")
        assert keeper.must_stop(task_id) is None
        os.kill(process.pid, signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            why = wait_for(lambda: keeper.must_stop(task_id), 10, "the keeper to fence the job", poll=0.01)
            fenced_at = time.monotonic()
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # The lease was confirmed at most a renewal period before the pause, so the stop came
        # fence_after_s after that at the latest, and at least the stop's grace before the TTL.
        assert fenced_at - paused_at <= keeper.fence_after_s + 0.1, why
        assert fenced_at - paused_at < ttl_s - keeper.fence_grace_s, why
        assert "has not confirmed its lease" in why
        keeper.fenced(task_id, keep_s=0)
        wait_for(lambda: DeviceStats.parse(client.hgetall(keys.stats("cpu0"))).jobs_fenced == 1, 10,
                 "the stop reported")
        # Left to expire, never restored.
        wait_for(lambda: client.exists(keys.lease(task_id)) == 0, 10, "the lease to expire")
        time.sleep(ttl_s / 3 * 2)  # two of the keeper's beats: a restore would have come
        assert client.exists(keys.lease(task_id)) == 0 and keeper.held() == []
    finally:
        keeper.stop()
        keeper_client.close()


def test_three_partitions_do_not_dead_letter_a_healthy_job(client):
    """Each time its worker is cut off, a reaper counts a death; each report after the heal
    takes it back: the fourth take, bounded at three deaths, still runs the job."""
    jobs = JobState(client)
    task_id = str(uuid.uuid4())
    for pid in (5001, 5002, 5003):
        attempt = jobs.take(_record(task_id, pid=pid), 5000, max_attempts=3).attempt
        assert attempt is not None
        note = death_note(_record(task_id, pid=pid))
        assert jobs.reaped(task_id, attempt.lease, note, 0)  # cut off: seen dead
        client.delete(keys.lease(task_id))
        assert jobs.fenced(task_id, "cpu0", note, 0) == 1  # healed: it stopped the job itself
    taken = jobs.take(_record(task_id, device="cpu1"), 5000, max_attempts=3)
    assert taken.status is Took.OK and taken.attempt is not None and taken.attempt.token == 4
    assert client.llen(keys.worker_deaths(task_id)) == 0


@pytest.mark.timeout(180)
def test_a_reporting_job_is_stopped_while_redis_is_paused_and_runs_again(fleet, app, tmp_path):
    """A job that reports progress all the time, its worker's Redis paused (SIGSTOP): its
    run has ended before the lease's TTL has run out, though every report of it would wait
    on Redis; once Redis is back, the job runs again on the same worker (the lease left to
    expire is given back by the reaper) and ends ok, with no death counted and the stop counted."""
    import sys

    import tasks

    from .conftest import standalone_worker

    ttl_s = 2.0
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-n", "cpu6@%h"]
    with standalone_worker(fleet, "cpu6", argv, tmp_path / "cpu6.log", DEVICEFLEET_LEASE_TTL_S=str(ttl_s),
                           DEVICEFLEET_REAPER_INTERVAL_S="0.5", DEVICEFLEET_HEARTBEAT_INTERVAL_S="0.5",
                           DEVICEFLEET_HEARTBEAT_TTL_S="3"):
        marker = tmp_path / "runs"
        marker.mkdir()
        # A report every 0.1 s for 6 s: its first run is stopped within the TTL of the pause, which
        # follows its first report; its second runs in full.
        handle = tasks.fan_out({"cpu6": ("counted", {"marker": str(marker), "seconds": 6, "steps": 60})}, app=app)
        job_id = handle.task_ids["cpu6"]
        runs = marker / job_id
        wait_for(lambda: runs.exists() and runs.read_text().split(), 60, "the job to start")
        client = connect(fleet.redis_url)
        wait_for(lambda: client.get(keys.progress(job_id)), 30, "its reports to flow")
        redis_process = fleet.redis.process
        assert redis_process is not None
        os.kill(redis_process.pid, signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            log = tmp_path / "cpu6.log"
            wait_for(lambda: f"job {job_id} stopped: its worker fenced itself" in log.read_text(), ttl_s * 2,
                     "the job to stop", poll=0.02)
            gone_after_s = time.monotonic() - paused_at
        finally:
            os.kill(redis_process.pid, signal.SIGCONT)
        print(f"FENCING a reporting job stopped {gone_after_s:.2f} s into a Redis pause (lease TTL {ttl_s:g} s)")
        assert gone_after_s < ttl_s
        entry = handle.get(timeout=120)["cpu6"]
        assert entry["status"] == "ok", entry
        assert len(runs.read_text().split()) == 2  # it ran twice: stopped, then again
        assert client.llen(keys.worker_deaths(job_id)) == 0
        wait_for(lambda: DeviceStats.parse(client.hgetall(keys.stats("cpu6"))).jobs_fenced == 1, 30,
                 "the stop reported")
        client.close()
