"""Single worker components, in-process, against a real redis-server (no fleet, no mocked Redis).

One embedded redis-server serves the whole module; each test starts from an empty database.
The components: the lease keeper (tasks.worker.lease, its fence tasks.worker.fence) and the reaper
(tasks.worker.reaper), the registry heartbeat
(tasks.worker.heartbeat), the guarded task strategy and hardened transport (run inside a real
in-process Celery worker with the device-worker bootstep), the out-of-memory guard
(tasks.worker.oom) and the result backend (tasks.core.backend).
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context
from celery.exceptions import Ignore
from kombu import Exchange
from rich.console import Console

import tasks
from tasks.core import keys, transport
from tasks.core.app import FleetCelery, create_app
from tasks.core.backend import FleetBackend, attach_entry, entry_of_failure
from tasks.core.devices import format_core_list, host_name
from tasks.core.errors import (
    GangFailed,
    GiveWay,
    JobCancelled,
    JobError,
    OutOfMemory,
    PeerLost,
    WorkerLost,
    WorkerStopped,
)
from tasks.core.job import JobContext, JobMetric
from tasks.core.jobcount import JobCount
from tasks.core.jobstate import JobEnd, JobState, hand_over
from tasks.core.records import (
    BusyInfo,
    Entry,
    EntryStatus,
    ErrorInfo,
    GangSpec,
    LeaseRecord,
    ResendRecord,
    SlotRecord,
    WorkerRecord,
)
from tasks.core.registry import job_schemas, live_workers, read_worker
from tasks.core.rendezvous import Rendezvous
from tasks.core.settings import Settings
from tasks.core.wire import Outcome, RunJob, StopJob, StopReason, StoreOpened
from tasks.jobproc.oom import run_guarded
from tasks.jobproc.progress import VALUES_KEPT, ProgressThrottle
from tasks.jobproc.rank import peer_lost
from tasks.ops.exporter import fleet_snapshot
from tasks.ops.redis_server import EmbeddedRedis
from tasks.ops.status import render, report
from tasks.worker import gang as gang_module
from tasks.worker import lease as lease_module
from tasks.worker import reaper as reaper_module
from tasks.worker.admission import of_lease
from tasks.worker.disposition import Store, apply
from tasks.worker.gang import GangWatch
from tasks.worker.heartbeat import Heartbeat
from tasks.worker.lease import LeaseKeeper, Take
from tasks.worker.progress import publish, summary
from tasks.worker.reaper import Orphans, Reaper, reap_once
from tasks.worker.supervisor import Ended
from tests.conftest import cli_env, wait_for

OTHER_HOST = "host-of-another-worker"


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def settings(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings.load(
        redis_url=redis_server.url, state_dir=tmp_path_factory.mktemp("components-state"),
        job_modules=["tasks.jobs"], heartbeat_interval_s=0.5, heartbeat_ttl_s=5.0,
        lease_ttl_s=5.0, reaper_interval_s=0.5,
        # The in-process worker pins the thread that builds it to its cores: give it the ones
        # this process already has, so later tests keep them.
        cores=format_core_list(sorted(os.sched_getaffinity(0))),
    )


@pytest.fixture(scope="module")
def app(settings: Settings) -> Iterator[FleetCelery]:
    celery_app = create_app(settings, main="devicefleet-components")
    yield celery_app
    celery_app.close()


def worker_record(device: str, *, host: str | None = None, pid: int | None = None, **fields: Any) -> WorkerRecord:
    return WorkerRecord(
        device=device, kind="cpu", worker=f"{device}@{host or host_name()}", host=host or host_name(),
        pid=os.getpid() if pid is None else pid, queues=[f"device.{device}", "cpu", "fleet"], cores=[0],
        pool="threads", slots=fields.pop("slots", [SlotRecord(index=0, cores=[0])]), jobs=["noop"],
        started_at=time.time(), **fields,
    )


def register(client, record: WorkerRecord) -> None:  # type: ignore[no-untyped-def]
    """Make ``record``'s worker alive in the registry, as its heartbeat would."""
    client.set(keys.worker(record.device), record.to_json(), px=60_000)
    client.sadd(keys.WORKERS, record.device)


@contextmanager
def on_other_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the block as a worker process on another host (the lease code's view of "this process")."""
    with monkeypatch.context() as patch:
        patch.setattr(lease_module, "host_name", lambda: OTHER_HOST)
        yield


def lease_of(client, task_id: str) -> LeaseRecord | None:  # type: ignore[no-untyped-def]
    raw = client.get(keys.lease(task_id))
    return LeaseRecord.model_validate_json(raw) if raw else None


# -- LeaseKeeper ------------------------------------------------------------------------------------


def test_acquire_writes_the_lease_with_a_ttl_and_release_removes_it(client):
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s=5.0)
    assert keeper.take("job-1", "tag-1").outcome is Take.TAKEN
    record = lease_of(client, "job-1")
    assert record is not None
    assert (record.device, record.worker, record.pid, record.host, record.task_id, record.delivery_tag) == (
        "cpu0", "cpu0@here", os.getpid(), host_name(), "job-1", "tag-1")
    assert 0 < client.pttl(keys.lease("job-1")) <= 5000
    assert client.hget(keys.LEASES, "job-1") == client.get(keys.lease("job-1"))
    assert keeper.held() == ["job-1"]

    keeper.release("job-1")
    assert client.exists(keys.lease("job-1")) == 0
    assert client.hexists(keys.LEASES, "job-1") == 0
    assert keeper.held() == []


def test_a_live_owners_lease_is_not_taken(client, monkeypatch):
    owner = LeaseKeeper(client, "cpu1", f"cpu1@{OTHER_HOST}", ttl_s=5.0)
    with on_other_host(monkeypatch):
        assert owner.take("job-2", "tag-a").outcome is Take.TAKEN
    register(client, worker_record("cpu1", host=OTHER_HOST))
    before = client.get(keys.lease("job-2"))

    other = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    assert other.take("job-2", "tag-b").outcome is not Take.TAKEN
    assert client.get(keys.lease("job-2")) == before
    assert client.hget(keys.LEASES, "job-2") == before
    assert other.held() == []


@pytest.mark.parametrize("registry", ["no record", "another process"])
def test_a_dead_owners_lease_is_taken_over(client, monkeypatch, registry):
    owner = LeaseKeeper(client, "cpu1", f"cpu1@{OTHER_HOST}", ttl_s=5.0)
    with on_other_host(monkeypatch):
        assert owner.take("job-3", "tag-a").outcome is Take.TAKEN
    if registry == "another process":  # the device's worker was restarted: a new pid owns cpu1
        register(client, worker_record("cpu1", host=OTHER_HOST, pid=os.getpid() + 1))

    successor = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    assert successor.take("job-3", "tag-b").outcome is Take.TAKEN
    record = lease_of(client, "job-3")
    assert record is not None and (record.device, record.delivery_tag) == ("cpu2", "tag-b")
    assert client.hget(keys.LEASES, "job-3") == record.to_json()


def test_release_and_renewal_leave_a_successors_lease_alone(client, monkeypatch):
    cut_off = LeaseKeeper(client, "cpu1", f"cpu1@{OTHER_HOST}", ttl_s=5.0)
    with on_other_host(monkeypatch):
        assert cut_off.take("job-4", "tag-a").outcome is Take.TAKEN
    successor = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    assert successor.take("job-4", "tag-b").outcome is Take.TAKEN  # cpu1 is not in the registry: dead
    theirs = client.get(keys.lease("job-4"))

    cut_off.tick()  # renewing: must not bring its own lease back over the successor's
    cut_off.release("job-4")  # releasing: must not delete the successor's
    assert client.get(keys.lease("job-4")) == theirs
    assert client.hget(keys.LEASES, "job-4") == theirs

    successor.release("job-4")
    assert client.exists(keys.lease("job-4")) == 0
    assert client.hexists(keys.LEASES, "job-4") == 0


def test_takeover_is_compare_and_set(client, monkeypatch):
    """Two workers taking over the same dead lease: the one whose read is stale gets nothing."""
    dead = LeaseKeeper(client, "cpu1", f"cpu1@{OTHER_HOST}", ttl_s=5.0)
    with on_other_host(monkeypatch):
        assert dead.take("job-5", "tag-a").outcome is Take.TAKEN
    winner = LeaseRecord(device="cpu3", worker="cpu3@elsewhere", pid=1, host="elsewhere", task_id="job-5",
                         since=time.time()).to_json()
    real_owner_alive = lease_module.owner_alive

    def another_worker_wins_meanwhile(redis_client, holder):  # type: ignore[no-untyped-def]
        alive = real_owner_alive(redis_client, holder)
        redis_client.set(keys.lease("job-5"), winner, px=5000)  # between our read and our write
        return alive

    monkeypatch.setattr(lease_module, "owner_alive", another_worker_wins_meanwhile)
    loser = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    assert loser.take("job-5", "tag-b").outcome is not Take.TAKEN
    assert client.get(keys.lease("job-5")) == winner
    assert loser.held() == []


def test_tick_renews_the_ttl_and_restores_a_lost_lease(client):
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s=6.0)
    assert keeper.take("job-6", None).outcome is Take.TAKEN
    client.pexpire(keys.lease("job-6"), 500)
    assert client.pttl(keys.lease("job-6")) <= 500
    keeper.tick()
    assert 500 < client.pttl(keys.lease("job-6")) <= 6000

    value = client.get(keys.lease("job-6"))
    client.delete(keys.lease("job-6"), keys.LEASES)  # as after a Redis restart that lost them
    keeper.tick()
    assert client.get(keys.lease("job-6")) == value
    assert client.hget(keys.LEASES, "job-6") == value


def test_the_keeper_thread_renews_held_leases(client):
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s=1.5)  # renews every 0.5 s
    assert keeper.take("job-7", None).outcome is Take.TAKEN
    keeper.start()
    try:
        client.pexpire(keys.lease("job-7"), 300)
        wait_for(lambda: client.pttl(keys.lease("job-7")) > 300, 30, "the keeper thread to renew the lease")
    finally:
        keeper.stop()
    assert not keeper.alive


def _job_task(app: FleetCelery, task_id: str):  # type: ignore[no-untyped-def]
    """A task of ``app`` with a request as a worker would see it for ``task_id``."""
    if "devicefleet.components.job" not in app.tasks:
        def components_job() -> None:
            return None

        app.task(name="devicefleet.components.job", shared=False)(components_job)
    task = app.tasks["devicefleet.components.job"]
    task.push_request(id=task_id, delivery_info={"routing_key": "device.cpu9"},
                      properties={"delivery_tag": f"tag-{task_id}"}, kwargs={"epochs": 1}, headers={})
    return task


def _run_of(keeper: LeaseKeeper, task: Any) -> Any:
    """What :func:`tasks.worker.disposition.apply` needs of a job's run; its end's store is a
    cancelled job's (REVOKED stored, nothing more for Celery to store)."""
    return SimpleNamespace(task=task, worker=SimpleNamespace(leases=keeper), job_id=str(task.request.id),
                           end=lambda ended=None, failed=None: None)


@contextmanager
def held_lease(keeper: LeaseKeeper, task: Any, max_attempts: int | None = None) -> Iterator[Any]:
    """``task``'s lease as the runner holds it (:func:`tasks.worker.admission.admit`): taken for
    the block, or its refusal applied (:func:`tasks.worker.disposition.apply` raises Celery's
    exception for it); a lost job's WorkerLost raised, as the runner stores it."""
    taken = keeper.hold(task, max_attempts=max_attempts)
    if taken.error is not None:
        raise taken.error
    refused = of_lease(SimpleNamespace(service=None), str(task.request.id), taken)
    if refused is not None:
        apply(refused, _run_of(keeper, task), ran=False)
    with keeper.running(str(task.request.id)):
        yield taken.attempt


def test_hold_takes_the_lease_for_the_block_and_records_how_to_resend(client, app):
    keeper = LeaseKeeper(client, "cpu9", "cpu9@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    task = _job_task(app, task_id)
    try:
        with held_lease(keeper, task):
            record = lease_of(client, task_id)
            assert record is not None and record.delivery_tag == f"tag-{task_id}"
            assert record.resend is not None
            assert (record.resend.name, record.resend.queue, record.resend.kwargs) == (
                "devicefleet.components.job", "device.cpu9", {"epochs": 1})
        # Held until the result is stored (the worker's task_postrun settles it: with no end
        # stored, it releases it, as here).
        assert keeper.held() == [task_id] and client.exists(keys.lease(task_id)) == 1
        keeper.release(task_id)
        assert client.exists(keys.lease(task_id)) == 0
        assert keeper.held() == []
    finally:
        task.pop_request()


def test_a_copy_redelivered_as_its_original_finishes_never_runs(client, app, monkeypatch):
    """The window between a job's return and its stored result: the lease still covers it, and
    goes only in the script call that stores the result."""
    keeper = LeaseKeeper(client, "cpu1", f"cpu1@{OTHER_HOST}", ttl_s=5.0)
    register(client, worker_record("cpu1", host=OTHER_HOST))  # the original's worker is alive
    task_id = str(uuid.uuid4())
    task = _job_task(app, task_id)
    copy = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    runs = []
    try:
        with on_other_host(monkeypatch), held_lease(keeper, task):
            runs.append("original")
            assert app.backend.get_task_meta(task_id)["status"] == "STARTED"  # stored by the take
        # The function has returned; Celery has not stored the result yet. A copy now:
        with pytest.raises(Ignore), held_lease(copy, task):
            runs.append("copy, before the result is stored")
        # What the runner hands the backend, Celery's store of the result, and the worker's
        # task_postrun after it:
        hand_over(task.request, JobEnd(attempt=keeper.finishing(task_id)))
        app.backend.store_result(task_id, {"done": True}, "SUCCESS", request=task.request)
        keeper.settle(task_id, task.request)
        assert keeper.held() == [] and client.exists(keys.lease(task_id)) == 0  # released with it
        # A copy after that finds the result stored.
        with pytest.raises(Ignore), held_lease(copy, task):
            runs.append("copy, after the release")
    finally:
        task.pop_request()
    assert runs == ["original"]
    assert client.exists(keys.lease(task_id)) == 0 and client.hexists(keys.LEASES, task_id) == 0
    assert copy.held() == []


def test_the_store_script_counts_the_job_and_releases_its_lease_with_the_result(client, app):
    keeper = LeaseKeeper(client, "cpu3", "cpu3@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    assert keeper.take(task_id, None).outcome is Take.TAKEN
    count = JobCount(device="cpu3", ok=True, worker="cpu3@here", busy_seconds=2.5, last_finished_at=102.5,
                     metrics={JobMetric.SAMPLES: 64, JobMetric.SAMPLES_PER_S: 0.25})
    request = Context(id=task_id)
    hand_over(request, JobEnd(attempt=keeper.finishing(task_id), count=count))
    app.backend.store_result(task_id, {"done": True}, "SUCCESS", request=request)
    keeper.settle(task_id, request)  # the worker's task_postrun

    assert app.backend.get_task_meta(task_id)["result"] == {"done": True}
    assert client.exists(keys.lease(task_id)) == 0 and client.hexists(keys.LEASES, task_id) == 0
    assert keeper.held() == []
    stats = client.hgetall(keys.stats("cpu3"))
    assert (stats["jobs_ok"], float(stats["busy_seconds"]), float(stats[JobMetric.SAMPLES.value])) == ("1", 2.5, 64.0)
    assert (stats["worker"], float(stats["last_finished_at"]), float(stats[f"last_{JobMetric.SAMPLES_PER_S.value}"])) == (
        "cpu3@here", 102.5, 0.25)
    assert client.smembers(keys.STATS_DEVICES) == {"cpu3"}
    assert client.zrange(keys.finished("cpu3"), 0, -1, withscores=True) == [(task_id, 102.5)]

    # A second store (a copy that ran anyway) over the finished result: nothing stored or counted.
    again = Context(id=task_id)
    hand_over(again, JobEnd(count=count))
    app.backend.store_result(task_id, {"done": "twice"}, "SUCCESS", request=again)
    assert app.backend.get_task_meta(task_id, cache=False)["result"] == {"done": True}
    assert client.hget(keys.stats("cpu3"), "jobs_ok") == "1"


def test_renewal_never_restores_a_lease_handed_to_the_store(client):
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s=5.0)
    assert keeper.take("job-8", None).outcome is Take.TAKEN
    assert keeper.finishing("job-8").lease == client.get(keys.lease("job-8"))  # type: ignore[union-attr]
    client.delete(keys.lease("job-8"), keys.LEASES)  # as the store script does
    keeper.tick()  # before the worker forgot it: must not bring it back
    assert client.exists(keys.lease("job-8")) == 0 and client.hexists(keys.LEASES, "job-8") == 0
    keeper.forget("job-8")
    assert keeper.held() == []


def test_hold_releases_at_once_when_the_block_ignores_or_the_worker_goes_down(client, app):
    keeper = LeaseKeeper(client, "cpu9", "cpu9@here", ttl_s=5.0)
    for exc in (Ignore(), KeyboardInterrupt()):
        task_id = str(uuid.uuid4())
        task = _job_task(app, task_id)
        try:
            with pytest.raises(type(exc)), held_lease(keeper, task):
                if isinstance(exc, Ignore):  # a cancelled job: its state stored, nothing more to store
                    apply(Store(ended=Ended.by_worker(JobCancelled, "cancelled", pid=0, retired=None,
                                                      outcome=Outcome.CANCELLED)), _run_of(keeper, task), ran=False)
                raise exc
        finally:
            task.pop_request()
        assert client.exists(keys.lease(task_id)) == 0 and keeper.held() == []


def test_hold_drops_a_copy_of_a_job_that_already_finished(client, app):
    keeper = LeaseKeeper(client, "cpu9", "cpu9@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, {"done": True}, "SUCCESS")
    task = _job_task(app, task_id)
    ran = False
    try:
        with pytest.raises(Ignore):
            with held_lease(keeper, task):
                ran = True
    finally:
        task.pop_request()
    assert not ran
    assert client.exists(keys.lease(task_id)) == 0, "the dropped copy left its lease behind"
    assert keeper.held() == []


def test_hold_drops_a_second_copy_running_in_the_same_process(client, app):
    keeper = LeaseKeeper(client, "cpu9", "cpu9@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    task = _job_task(app, task_id)
    try:
        with held_lease(keeper, task):
            value = client.get(keys.lease(task_id))
            with pytest.raises(Ignore):
                with held_lease(keeper, task):
                    pytest.fail("a second copy ran while the first runs")
            # The dropped copy must not have released the running copy's lease.
            assert client.get(keys.lease(task_id)) == value
            assert keeper.held() == [task_id]
        keeper.release(task_id)
        assert client.exists(keys.lease(task_id)) == 0
    finally:
        task.pop_request()


# -- Reaper -----------------------------------------------------------------------------------------


def _dead_lease(client, task_id: str, *, tag: str | None = None, resend: ResendRecord | None = None,  # type: ignore[no-untyped-def]
                device: str = "cpu5", pid: int = 4_000_000) -> LeaseRecord:
    """A lease recorded in the leases hash whose key has expired (it is not written)."""
    record = LeaseRecord(device=device, worker=f"{device}@{OTHER_HOST}", pid=pid, host=OTHER_HOST,
                         task_id=task_id, delivery_tag=tag, since=time.time(), resend=resend)
    client.hset(keys.LEASES, task_id, record.to_json())
    return record


NOOP_RESEND = ResendRecord(name="devicefleet.noop", queue="device.cpu9", kwargs={})


def _queued(client, queue: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    return [json.loads(raw) for raw in client.lrange(queue, 0, -1)]


def test_reaper_resends_a_dead_owners_job_whose_message_is_gone(client, app):
    task_id = str(uuid.uuid4())
    _dead_lease(client, task_id, resend=NOOP_RESEND)
    assert reap_once(client, app) == [task_id]
    messages = _queued(client, "device.cpu9")
    assert [(m["headers"]["id"], m["headers"]["task"]) for m in messages] == [(task_id, "devicefleet.noop")]
    assert client.hexists(keys.LEASES, task_id) == 0
    assert client.hget(keys.REAPER_STATS, "restored") == "1"
    assert reap_once(client, app) == []  # given back once only
    assert client.llen("device.cpu9") == 1


def test_reaper_restores_an_unacked_message_to_its_queue_once(client, app):
    sent = app.send_task("devicefleet.noop", queue="device.cpu9")
    with app.connection_for_read() as consumer_conn:
        channel = consumer_conn.channel()
        message = channel.basic_get("device.cpu9", no_ack=False)  # delivered, never acknowledged
        assert message is not None and message.headers["id"] == sent.id
        tag = message.delivery_tag
        assert client.hexists("unacked", tag)
        assert client.llen("device.cpu9") == 0
        _dead_lease(client, sent.id, tag=tag)

        assert reap_once(client, app) == [sent.id]
        assert [m["headers"]["id"] for m in _queued(client, "device.cpu9")] == [sent.id]
        assert not client.hexists("unacked", tag), "still in unacked: the transport would restore it again"
        channel.close()  # the consumer's own restore of its unacked messages finds nothing to do
    assert client.llen("device.cpu9") == 1
    assert client.hget(keys.REAPER_STATS, "restored") == "1"


def test_reaper_leaves_live_owners_and_unexpired_leases_alone(client, app):
    live = str(uuid.uuid4())
    record = _dead_lease(client, live, resend=NOOP_RESEND, device="cpu5", pid=os.getpid())
    register(client, worker_record("cpu5", host=OTHER_HOST, pid=record.pid))  # alive, late to renew
    unexpired = str(uuid.uuid4())
    _dead_lease(client, unexpired, resend=NOOP_RESEND, device="cpu6")
    client.set(keys.lease(unexpired), "held", px=60_000)

    assert reap_once(client, app) == []
    assert client.hexists(keys.LEASES, live) and client.hexists(keys.LEASES, unexpired)
    assert client.llen("device.cpu9") == 0
    assert client.hget(keys.REAPER_STATS, "restored") is None


def test_an_orphaned_lease_of_a_live_owner_is_given_back_after_its_grace_with_no_death(client, app):
    # A failover lost the store of the job's result (which released its lease and acked its
    # message): the owner, alive, forgot the lease, so its key expired and nobody renews it.
    sent = app.send_task("devicefleet.noop", queue="device.cpu9")
    with app.connection_for_read() as consumer_conn:
        channel = consumer_conn.channel()
        message = channel.basic_get("device.cpu9", no_ack=False)
        assert message is not None
        orphan = _dead_lease(client, sent.id, tag=message.delivery_tag, device="cpu5", pid=os.getpid())
        # Another job of the same live owner, still running (busy in its record): never given back.
        running = str(uuid.uuid4())
        _dead_lease(client, running, resend=NOOP_RESEND, device="cpu5", pid=os.getpid())
        busy = SlotRecord(index=0, cores=[0], busy=BusyInfo(job="noop", job_id=running, since=time.time()))
        register(client, worker_record("cpu5", host=OTHER_HOST, pid=orphan.pid, slots=[busy]))
        orphans = Orphans(grace_s=0.3)

        assert reap_once(client, app, orphans) == []  # first seen: the owner may be late to renew
        assert reap_once(client, app) == []  # without the orphan watch: a live owner is left alone
        wait_for(lambda: reap_once(client, app, orphans) == [sent.id], 10, "the orphan given back after its grace")
        assert [m["headers"]["id"] for m in _queued(client, "device.cpu9")] == [sent.id]
        assert not client.hexists("unacked", message.delivery_tag)
        assert not client.hexists(keys.LEASES, sent.id) and client.hexists(keys.LEASES, running)
        assert _deaths(client, sent.id) == []  # the owner did not die
        assert client.hgetall(keys.REAPER_STATS) == {"restored": "1", "orphans": "1"}
        channel.close()
    # A lease record that changed (the owner took the job again) starts its grace over.
    assert not orphans.due(running, "another record")


def test_one_reaper_at_a_time(client, app):
    task_id = str(uuid.uuid4())
    _dead_lease(client, task_id, resend=NOOP_RESEND)
    reaper = Reaper(client, app, interval_s=0.5, orphan_grace_s=10.0)
    other_reaper = client.lock(keys.REAPER_LOCK, timeout=30)
    assert other_reaper.acquire(blocking=False)
    try:
        reaper.tick()
        assert client.hexists(keys.LEASES, task_id), "reaped while another reaper held the lock"
        assert client.llen("device.cpu9") == 0
    finally:
        other_reaper.release()
    reaper.tick()
    assert not client.hexists(keys.LEASES, task_id)
    assert client.llen("device.cpu9") == 1
    assert client.exists(keys.REAPER_LOCK) == 0, "the reaper kept the lock after its round"


def test_a_reaper_round_with_nothing_expired_is_one_script_call(client, app):
    keeper = LeaseKeeper(client, "cpu0", "cpu0@here", ttl_s=5.0)
    assert keeper.take("job-9", None).outcome is Take.TAKEN  # a live lease, its key in place: not a candidate
    reaper = Reaper(client, app, interval_s=0.5, orphan_grace_s=10.0)
    reaper.tick()  # loads the script
    client.config_resetstat()
    connections = client.info("stats")["total_connections_received"]
    reaper.tick()
    calls = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in client.info("commandstats").items()
             if not name.startswith(("cmdstat_config", "cmdstat_info"))}  # this test's own
    # The script: its turn (kept), its look; no lock, no broker connection.
    assert calls == {"evalsha": 1, "get": 1, "set": 1, "hgetall": 1, "exists": 1}
    assert client.info("stats")["total_connections_received"] == connections
    assert client.hexists(keys.LEASES, "job-9")


def test_one_reaper_looks_a_turn_and_another_after_it(client, app):
    task_id = str(uuid.uuid4())
    _dead_lease(client, task_id, resend=NOOP_RESEND)
    jobs = JobState(client)
    assert list(jobs.expired_on_turn("a", 500) or {}) == [task_id]  # a's turn, for 0.5 s
    client.config_resetstat()
    assert jobs.expired_on_turn("b", 500) is None  # not b's turn: no scan
    calls = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in client.info("commandstats").items()
             if not name.startswith(("cmdstat_config", "cmdstat_info"))}
    assert calls == {"evalsha": 1, "get": 1}
    assert list(jobs.expired_on_turn("a", 500) or {}) == [task_id]  # a's own turn: a may look again
    first = Reaper(client, app, interval_s=0.5, orphan_grace_s=10.0, token="a")
    second = Reaper(client, app, interval_s=0.5, orphan_grace_s=10.0, token="b")
    second.tick()
    assert client.hexists(keys.LEASES, task_id) and client.llen("device.cpu9") == 0, "reaped on another's turn"
    wait_for(lambda: not client.exists(keys.REAPER_TURN), 10, "a's turn to expire (a dead reaper's ends so)")
    second.tick()  # b's turn now
    assert not client.hexists(keys.LEASES, task_id) and client.llen("device.cpu9") == 1
    assert client.get(keys.REAPER_TURN) == "b"
    first.tick()
    assert client.get(keys.REAPER_TURN) == "b" and 0 < client.pttl(keys.REAPER_TURN) <= 500


def test_a_reaper_watching_an_orphan_looks_on_others_turns_and_gives_it_back_after_its_grace(client, app):
    orphan = str(uuid.uuid4())
    record = _dead_lease(client, orphan, resend=NOOP_RESEND, device="cpu5", pid=os.getpid())
    register(client, worker_record("cpu5", host=OTHER_HOST, pid=record.pid))  # alive, runs nothing
    reaper = Reaper(client, app, interval_s=0.1, orphan_grace_s=0.3, token="a")
    reaper.tick()  # its turn: the orphan first seen
    assert reaper.orphans.pending and client.hexists(keys.LEASES, orphan)
    client.set(keys.REAPER_TURN, "b", px=60_000)  # another reaper's turn from now on
    wait_for(lambda: (reaper.tick(), not client.hexists(keys.LEASES, orphan))[1], 10, "the orphan given back")
    assert client.llen("device.cpu9") == 1
    reaper.tick()  # its next look finds it gone: watched no more
    assert not reaper.orphans.pending
    assert client.hgetall(keys.REAPER_STATS) == {"restored": "1", "orphans": "1"}
    # Not watching one, it looks on its turns only: another's costs no scan.
    again = str(uuid.uuid4())
    _dead_lease(client, again, resend=NOOP_RESEND, device="cpu5", pid=os.getpid())
    reaper.tick()
    assert not reaper.orphans.pending


def test_the_reaper_thread_gives_back_jobs(client, app):
    reaper = Reaper(client, app, interval_s=0.1, orphan_grace_s=10.0)
    reaper.start()
    try:
        ids = [str(uuid.uuid4()) for _ in range(3)]
        for task_id in ids:
            _dead_lease(client, task_id, resend=NOOP_RESEND)
        wait_for(lambda: client.llen("device.cpu9") == 3, 10, "the reaper thread to give back 3 jobs")
    finally:
        reaper.stop()
    assert sorted(m["headers"]["id"] for m in _queued(client, "device.cpu9")) == sorted(ids)
    assert client.hget(keys.REAPER_STATS, "restored") == "3"


# -- Heartbeat --------------------------------------------------------------------------------------


def test_heartbeat_registers_updates_and_leaves(client):
    beat = Heartbeat(client, worker_record("cpu7"), interval_s=30.0, ttl_s=60.0)
    beat.start()  # written before start returns
    try:
        assert 0 < client.pttl(keys.worker("cpu7")) <= 60_000
        assert client.smembers(keys.WORKERS) == {"cpu7"}
        live = live_workers(client)
        assert list(live) == ["cpu7"]
        assert isinstance(live["cpu7"], WorkerRecord)
        assert live["cpu7"].pid == os.getpid() and live["cpu7"].busy is None
        assert live["cpu7"].heartbeat_at is not None

        # The interval is 30 s: the change is visible at once only because update wakes the thread.
        busy = BusyInfo(job="noop", job_id="j-1", since=time.time())
        beat.update_slot(0, busy=busy, progress={"step": 3})
        record = wait_for(lambda: (r := read_worker(client, "cpu7")) is not None and r.busy is not None and r,
                          30, "the busy record in Redis")
        assert record.busy == busy and record.slots[0].progress == {"step": 3}
        beat.update_slot(0, busy=None, worker_fields={"jobs_done": 1})
        record = wait_for(lambda: (r := read_worker(client, "cpu7")) is not None and r.busy is None and r,
                          30, "the idle record in Redis")
        assert record.jobs_done == 1
    finally:
        beat.stop(timeout=5)
    assert not beat.alive
    assert client.exists(keys.worker("cpu7")) == 0
    assert client.smembers(keys.WORKERS) == set()
    assert live_workers(client) == {}


def test_heartbeat_thread_refreshes_the_ttl(client):
    beat = Heartbeat(client, worker_record("cpu7"), interval_s=0.2, ttl_s=5.0)
    beat.start()
    try:
        client.pexpire(keys.worker("cpu7"), 1000)
        wait_for(lambda: client.pttl(keys.worker("cpu7")) > 1000, 30, "a beat to refresh the TTL")
    finally:
        beat.stop(timeout=5)


def test_heartbeat_updates_closer_than_after_s_go_out_in_one_write(client):
    class CountingHeartbeat(Heartbeat):
        writes = 0

        def write(self) -> None:
            # Counted before it goes out: the test reads the count once Redis has the write,
            # which may be before this thread returns from it.
            self.writes += 1
            super().write()

    beat = CountingHeartbeat(client, worker_record("cpu7"), interval_s=30.0, ttl_s=60.0)
    beat.start()  # one write
    try:
        asked = time.monotonic()
        # A short job: busy, then idle, then the next job's busy, all within after_s.
        beat.update_slot(0, busy=BusyInfo(job="noop", job_id="j-1", since=time.time()), after_s=0.3)
        beat.update_slot(0, busy=None, worker_fields={"jobs_done": 1}, after_s=0.3)
        beat.update_slot(0, busy=BusyInfo(job="noop", job_id="j-2", since=time.time()), after_s=0.3)
        record = wait_for(lambda: (r := read_worker(client, "cpu7")) is not None and r.jobs_done == 1 and r,
                          30, "the coalesced write")
        written = time.monotonic()
        assert record.busy is not None and record.busy.job_id == "j-2"  # the latest fields
        assert beat.writes == 2  # the start's, and one for all three updates
        assert written - asked >= 0.3  # not before the first update's after_s
        beat.update_slot(0, busy=None, worker_fields={"jobs_done": 2})  # after_s=0: at once (the interval is 30 s)
        wait_for(lambda: (r := read_worker(client, "cpu7")) is not None and r.jobs_done == 2, 30, "an immediate write")
        assert beat.writes == 3
    finally:
        beat.stop(timeout=5)


def test_update_before_start_writes_at_once(client):
    beat = Heartbeat(client, worker_record("cpu8"), interval_s=30.0, ttl_s=60.0)
    beat.update(ready=True)
    record = read_worker(client, "cpu8")
    assert record is not None and record.ready


def test_a_heartbeat_that_left_writes_no_more(client):
    # A job that ends while its worker leaves updates the record: the device must not come back
    # into the registry for a TTL.
    beat = Heartbeat(client, worker_record("cpu7"), interval_s=30.0, ttl_s=60.0)
    beat.start()
    beat.stop(timeout=5)
    assert client.exists(keys.worker("cpu7")) == 0
    beat.update_slot(0, busy=None, worker_fields={"jobs_done": 1})
    beat.update(ready=True)
    assert client.exists(keys.worker("cpu7")) == 0 and client.smembers(keys.WORKERS) == set()
    assert beat.record.jobs_done == 1  # kept in memory all the same


def test_a_heartbeat_that_never_wrote_leaves_the_owners_record(client):
    # A worker refused because its device is taken stops a heartbeat that never started: the
    # live owner's record stays.
    owner = worker_record("cpu7")
    register(client, owner)
    refused = Heartbeat(client, worker_record("cpu7"), interval_s=30.0, ttl_s=60.0)
    refused.stop(timeout=5)
    assert read_worker(client, "cpu7") == owner and client.smembers(keys.WORKERS) == {"cpu7"}


def test_heartbeat_publishes_job_schemas_once_with_the_records_ttl(client):
    client.hset(keys.job_schemas("cpu7"), mapping={"gone": "{}"})  # a predecessor's, other modules
    schemas = {"train": json.dumps({"type": "object"}), "probe": "{}"}
    beat = Heartbeat(client, worker_record("cpu7"), interval_s=30.0, ttl_s=60.0, schemas=schemas)
    beat.start()
    try:
        assert client.hgetall(keys.job_schemas("cpu7")) == schemas
        assert 0 < client.pttl(keys.job_schemas("cpu7")) <= 60_000
        assert job_schemas(client, [("cpu7", "train"), ("cpu7", "nope"), ("cpu8", "train")]) == {
            ("cpu7", "train"): schemas["train"]}
        client.hset(keys.job_schemas("cpu7"), "train", "marked")  # not rewritten by a beat...
        beat.write()
        assert client.hget(keys.job_schemas("cpu7"), "train") == "marked"
        client.delete(keys.job_schemas("cpu7"))  # ...unless Redis lost them (a failover)
        beat.write()  # renews nothing, so the next beat writes them again
        beat.write()
        assert client.hgetall(keys.job_schemas("cpu7")) == schemas
    finally:
        beat.stop(timeout=5)
    assert client.exists(keys.job_schemas("cpu7")) == 0


def test_live_workers_skips_expired_and_malformed_records(client):
    register(client, worker_record("cpu1"))
    client.sadd(keys.WORKERS, "cpu2")  # registered once, its record expired
    client.set(keys.worker("cpu3"), '{"device": "cpu3"}')
    client.sadd(keys.WORKERS, "cpu3")
    assert list(live_workers(client)) == ["cpu1"]


# -- the guarded strategy, in a real in-process Celery worker -------------------------------------


def _raw_publish(app: FleetCelery, queue: str, body: bytes, headers: dict[str, Any]) -> None:
    """Publish ``body`` as is, in a kombu envelope, to ``queue``."""
    with app.producer_or_acquire() as producer:
        producer.publish(body, exchange=Exchange(""), routing_key=queue, content_type="application/json",
                         content_encoding="binary", headers=headers, serializer=None)


@contextmanager
def in_process_worker(client, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A real Celery worker of a devicefleet app (its device-worker bootstep included), in a thread.

    Yields (app, worker, device); on leaving, the worker stops as the test harness stops it
    (Celery's cold shutdown).
    """
    import torch
    from celery import _state
    from celery.contrib.testing.worker import start_worker

    # torch may already be loaded in this process (other tests): pin what it sees first, and name
    # the worker after a device it can own here (a CPU worker refuses to start if it sees a GPU).
    device = "gpu0" if torch.cuda.is_available() else "cpu9"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0" if device == "gpu0" else "-1")
    threads = torch.get_num_threads()
    previous_default, previous_current = _state.default_app, getattr(_state._tls, "current_app", None)
    app = create_app(settings.model_copy(update={"state_dir": tmp_path}), main="devicefleet-worker-test")
    app.conf.worker_hijack_root_logger = False
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30,
                          hostname=f"{device}@{socket.gethostname()}", loglevel="WARNING") as worker:
            wait_for(lambda: (r := read_worker(client, device)) is not None and r.ready, 30,
                     f"the in-process {device} worker to be ready")
            yield app, worker, device
    finally:
        torch.set_num_threads(threads)
        _state.set_default_app(previous_default)
        _state._tls.current_app = previous_current
        app.close()


def test_malformed_messages_never_stop_a_worker(client, settings, tmp_path, monkeypatch):
    with in_process_worker(client, settings, tmp_path, monkeypatch) as (app, worker, device):
        queue = f"device.{device}"
        headers = {"lang": "py", "task": "devicefleet.noop", "argsrepr": "", "kwargsrepr": "", "origin": "test"}
        shapeless = str(uuid.uuid4())
        bad_args = str(uuid.uuid4())
        # 1. bytes pushed straight into the list: not a kombu envelope at all.
        client.lpush(queue, "garbage\x00not json")
        # 2. a kombu envelope whose task body is not [args, kwargs, embed].
        _raw_publish(app, queue, b'"just a string"', {**headers, "id": shapeless, "root_id": shapeless})
        # 3. the right length, the wrong kinds.
        _raw_publish(app, queue, b'[1, 2, 3]', {**headers, "id": bad_args, "root_id": bad_args})
        # 4. a malformed body naming no task id.
        _raw_publish(app, queue, b'{"a": 1}', headers)

        # Sent last: it runs only if the worker consumed past every bad message and is still up.
        good = app.send_task("devicefleet.noop", queue=queue)
        entry = good.get(timeout=30)
        assert entry["status"] == "ok" and entry["device"] == device and entry["output"] == {"device": device}

        for task_id, what in ((shapeless, "the body must be [args, kwargs, embed]"),
                              (bad_args, "args must be a list")):
            result = app.AsyncResult(task_id)
            assert result.state == "FAILURE", f"no stored failure for the malformed message {task_id}"
            assert "malformed devicefleet.noop message" in str(result.result)
            assert what in str(result.result)
        assert client.llen(queue) == 0
        # The good job is acknowledged just after its result is stored (late acks).
        wait_for(lambda: client.hlen("unacked") == 0, 10,
                 "every message acknowledged or rejected (none left for a redelivery)")
        assert worker.blueprint.state == 1  # celery.bootsteps.RUN
        device_worker = worker.device_worker
        background = [device_worker.heartbeat, device_worker.leases, device_worker.reaper]
        assert all(thread is not None and thread.alive for thread in background)

    # Stopped (a cold shutdown, as the test harness stops it): the device left the registry.
    assert read_worker(client, device) is None
    assert device not in client.smembers(keys.WORKERS)
    assert not any(thread.alive for thread in background), "a background thread outlived its worker"


@contextmanager
def redis_monitor(client) -> Iterator[list[dict[str, Any]]]:  # type: ignore[no-untyped-def]
    """Every command Redis runs while the block runs (redis-py's MONITOR), those scripts run
    included (``client_type`` ``lua``)."""
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def listen() -> None:
        with client.monitor() as monitor:
            for command in monitor.listen():
                seen.append(command)
                if stop.is_set() and command["command"] == "ECHO monitor-end":
                    return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    wait_for(lambda: client.echo("monitor-start") and any(c["command"] == "ECHO monitor-start" for c in seen),
             10, "MONITOR to start")
    try:
        yield seen
    finally:
        stop.set()
        client.echo("monitor-end")
        thread.join(60)
    assert not thread.is_alive(), "MONITOR never saw the end of the block: the commands seen are not all"


@contextmanager
def channel_acks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], list[str]]]:
    """Count the acknowledgements the worker's channel makes (the hardened transport's
    ``QoS.ack``, which Celery calls in the worker's thread *after* the job's result is stored:
    a producer holding the result may be ahead of it). Yields ``wait(n)``, which returns the
    delivery tags once ``n`` were acknowledged."""
    acked: list[str] = []
    changed = threading.Condition()
    ack = transport.QoS.ack

    def counted(qos: transport.QoS, delivery_tag: str) -> None:
        ack(qos, delivery_tag)
        with changed:
            acked.append(delivery_tag)
            changed.notify_all()

    def wait(n: int) -> list[str]:
        with changed:
            assert changed.wait_for(lambda: len(acked) >= n, timeout=60), f"{len(acked)} of {n} acknowledged"
            return list(acked)

    with monkeypatch.context() as patch:
        patch.setattr(transport.QoS, "ack", counted)
        yield wait


def test_a_jobs_message_is_acknowledged_by_the_script_that_stores_its_result(client, settings, tmp_path, monkeypatch):
    with in_process_worker(client, settings, tmp_path, monkeypatch) as (app, worker, device), \
            channel_acks(monkeypatch) as acknowledged:
        jobs = 5
        with redis_monitor(client) as seen:
            for _ in range(jobs):
                assert app.send_task("devicefleet.noop", queue=f"device.{device}").get(timeout=30)["status"] == "ok"
            # The channel's own acknowledgements, inside the block: a round trip one made is seen.
            assert len(acknowledged(jobs)) == jobs
            wait_for(lambda: client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0, 30,
                     "every message out of kombu's unacked hash and index")
        acks = [c for c in seen if c["command"].lower().startswith("zrem unacked_index")]
        # Each job's message left kombu's unacked index in the store script, none in a round trip
        # of kombu's own acknowledgement.
        assert [c["client_type"] for c in acks] == ["lua"] * jobs, acks
        # kombu's bookkeeping was done all the same: nothing for the channel to give back on close.
        qos = worker.consumer.task_consumer.channel.qos
        assert set(qos._delivered) <= set(qos._dirty), "a delivered message kombu still thinks is unacked"


# -- the out-of-memory guard ------------------------------------------------------------------------


def _accelerator() -> str:
    """The device a job would run on: CUDA where there is one; else a device string that is not
    the CPU either (the guard treats any non-CUDA device alike), so the fallback is visible."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "meta"


def _context(tmp_path: Path, torch_device: str) -> JobContext:
    return JobContext(device="gpu0", torch_device=torch_device, job_id="oom-job", artifacts_dir=tmp_path)


def _oom() -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_becomes_an_error_with_memory_figures(tmp_path):
    torch_device = _accelerator()
    calls: list[JobContext] = []

    def job(ctx: JobContext, params: Any) -> dict[str, Any]:
        calls.append(ctx)
        raise _oom()

    with pytest.raises(OutOfMemory) as caught:
        run_guarded(job, _context(tmp_path, torch_device), None, None)
    error = caught.value
    assert isinstance(error, JobError) and isinstance(error, MemoryError)
    assert error.memory["device"] == torch_device
    assert error.memory["process_rss_mib"] > 0
    assert "fallback='cpu'" in str(error)
    assert not error.recycle
    assert len(calls) == 1
    assert ErrorInfo.of(error).memory == error.memory


def test_out_of_memory_with_the_cpu_fallback_runs_again_on_the_cpu(tmp_path):
    torch_device = _accelerator()
    ctx = _context(tmp_path, torch_device)
    calls: list[JobContext] = []

    def job(ctx: JobContext, params: Any) -> dict[str, Any]:
        calls.append(ctx)
        if ctx.torch_device != "cpu":
            raise _oom()
        return {"loss": 0.5, "params": params}

    output, recycle = run_guarded(job, ctx, "p", "cpu")
    assert [(c.torch_device, c.fallback_from) for c in calls] == [(torch_device, None), ("cpu", torch_device)]
    assert ctx.torch_device == torch_device, "the caller's context was changed"
    assert output["loss"] == 0.5 and output["params"] == "p"
    assert output["fallback"]["from"] == torch_device and output["fallback"]["to"] == "cpu"
    assert output["fallback"]["memory"]["device"] == torch_device
    assert recycle is False


def test_out_of_memory_again_on_the_fallback_is_an_error(tmp_path):
    calls: list[str] = []

    def job(ctx: JobContext, params: Any) -> dict[str, Any]:
        calls.append(ctx.torch_device)
        raise _oom()

    with pytest.raises(OutOfMemory, match="again on the CPU fallback") as caught:
        run_guarded(job, _context(tmp_path, _accelerator()), None, "cpu")
    assert calls == [_accelerator(), "cpu"]
    assert caught.value.memory["device"] == _accelerator()


def test_other_errors_pass_through_the_guard_untouched(tmp_path):
    calls: list[str] = []

    def job(ctx: JobContext, params: Any) -> dict[str, Any]:
        calls.append(ctx.torch_device)
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        run_guarded(job, _context(tmp_path, _accelerator()), None, "cpu")
    assert calls == [_accelerator()], "a job that did not run out of memory ran again"


# -- the result backend -----------------------------------------------------------------------------


def _error_entry() -> Entry:
    return Entry.make(device="cpu4", worker="cpu4@here", output=None,
                      error=ErrorInfo(type="ValueError", message="boom"), started=1.0, finished=2.5)


def test_entry_of_failure():
    entry = _error_entry().to_dict()
    assert entry_of_failure({"exc_type": "ValueError", "exc_message": ["boom"], keys.ENTRY_FIELD: entry}) == entry

    made = entry_of_failure({"exc_type": "InvalidTaskError", "exc_message": ["malformed", "message"]})
    assert made["status"] == "error" and made["device"] == "" and made["output"] is None
    assert made["error"] == {"type": "InvalidTaskError", "message": "malformed message"}

    from_exception = entry_of_failure(KeyError("k"))
    assert from_exception["error"]["type"] == "KeyError"

    odd = entry_of_failure(42)
    assert odd["error"]["type"] == "FanOutError" and "42" in odd["error"]["message"]


def test_a_stored_failure_keeps_its_entry(client, app):
    backend = app.backend
    assert isinstance(backend, FleetBackend)
    entry = _error_entry()

    prepared = backend.prepare_exception(attach_entry(ValueError("boom"), entry))
    assert prepared[keys.ENTRY_FIELD] == entry.to_dict()
    assert keys.ENTRY_FIELD not in backend.prepare_exception(ValueError("plain"))

    task_id = str(uuid.uuid4())
    backend.mark_as_failure(task_id, attach_entry(ValueError("boom"), entry))
    stored = json.loads(client.get(f"celery-task-meta-{task_id}"))
    assert stored["status"] == "FAILURE"
    assert entry_of_failure(stored["result"]) == entry.to_dict()
    result = app.AsyncResult(task_id)
    assert result.state == "FAILURE"
    assert isinstance(result.result, ValueError) and str(result.result) == "boom"


def test_a_failure_is_final_for_a_fleet_job_and_not_for_any_other_task(client, app):
    """Celery never stores a state over a SUCCESS; a devicefleet job's FAILURE and REVOKED are
    as final. Any other task keeps Celery's rule: it may run again under its id after failing."""
    backend = app.backend
    for name, final in (("devicefleet.probe", True), ("myapp.add", False), (None, True)):
        task_id = str(uuid.uuid4())
        request = Context(id=task_id, task=name)
        backend.store_result(task_id, ValueError("boom"), "FAILURE", request=request)
        backend.store_result(task_id, {"pid": 1}, "STARTED", request=request)
        assert backend.get_task_meta(task_id, cache=False)["status"] == ("FAILURE" if final else "STARTED"), name
        backend.store_result(task_id, 3, "SUCCESS", request=request)
        backend.store_result(task_id, {"pid": 2}, "STARTED", request=request)  # never over a SUCCESS
        assert backend.get_task_meta(task_id, cache=False)["status"] == ("FAILURE" if final else "SUCCESS"), name


@pytest.mark.timeout(60)
def test_a_result_let_go_while_redis_is_down_never_reconnects_and_the_next_wait_does(tmp_path, caplog):
    """Stopping listening never retries (Celery's consumer retried each unsubscribe for the
    retry policy's two minutes, then logged that the app must be restarted); a result still
    awaited is read once Redis is back."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    celery_app = create_app(Settings.load(redis_url=server.url, state_dir=tmp_path / "state"), main="let-go")
    try:
        backend = celery_app.backend
        awaited, *let_go = (celery_app.AsyncResult(str(uuid.uuid4())) for _ in range(3))
        for result in (awaited, *let_go):
            backend.add_pending_result(result)
            backend.result_consumer.consume_from(result.id)
        server.stop()
        with caplog.at_level("DEBUG", logger="celery.backends"):
            for result in let_go:  # the first finds the socket closed; the next, the connection down
                backend.remove_pending_result(result)
        assert backend.result_consumer.subscribed_to == {backend.get_key_for_task(awaited.id)}
        assert [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
        server.start()
        backend.store_result(awaited.id, 5, "SUCCESS")
        assert awaited.get(timeout=30) == 5
    finally:
        celery_app.close()
        server.stop()


def test_only_a_fan_outs_chord_reads_a_failed_part_as_its_entry():
    from celery import signature

    from tasks.core.backend import fan_out_chord, fleet_task
    from tasks.core.job import COLLECT_TASK

    assert fan_out_chord(SimpleNamespace(chord=signature(COLLECT_TASK, kwargs={"devices": ["cpu0"]})))
    assert fan_out_chord(SimpleNamespace(chord={"task": COLLECT_TASK}))
    assert not fan_out_chord(SimpleNamespace(chord=signature("myapp.tsum")))
    assert not fan_out_chord(SimpleNamespace(chord=None))
    assert fleet_task(SimpleNamespace(task="devicefleet.train")) and fleet_task(None)
    assert not fleet_task(SimpleNamespace(task="t.integration.tasks.add"))


def test_importing_tasks_leaves_celerys_current_app_alone():
    code = ("from celery import Celery, current_app, shared_task\n"
            "mine = Celery('mine', set_as_current=True)\n"
            "import tasks, tasks.core.backend, tasks.core.transport\n"
            "assert current_app.main == 'mine', current_app.main\n"
            "@shared_task\ndef add(x, y): return x + y\n"
            "assert add.app is mine, add.app\n"
            "assert tasks.app.main == 'devicefleet'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=cli_env())


# -- progress: throttled, and the latest report always published -------------------------------


def _throttle(task, client, min_interval_s: float) -> ProgressThrottle:  # type: ignore[no-untyped-def]
    """A job process's throttle whose reports the worker publishes at once (as the pipe does)."""
    request = task.request
    return ProgressThrottle("cpu9", send=lambda meta: publish(task, request, meta, client=client, expires_s=60),
                            min_interval_s=min_interval_s)


def test_progress_is_throttled_and_the_latest_report_always_goes_out(client, app):
    task_id = str(uuid.uuid4())
    task = _job_task(app, task_id)
    key = keys.progress(task_id)
    try:
        publisher = _throttle(task, client, min_interval_s=0.2)
        started = time.monotonic()
        for step in range(1, 1001):
            publisher.report({"step": step, "total": 1000})
        elapsed = time.monotonic() - started
        # 1,000 reports cost a publish per interval (the first at once), not one each.
        assert publisher.published <= 1 + elapsed / 0.2 + 1
        # The latest goes out when the interval has passed, with no further report.
        wait_for(lambda: json.loads(client.get(key) or "{}").get("step") == 1000, 10, "the trailing report")
        assert json.loads(client.get(key)) == {"device": "cpu9", "step": 1000, "total": 1000}
        result = app.AsyncResult(task_id)
        assert result.state == "PROGRESS" and result.info["step"] == 1000
        # At the job's end, flush publishes a report that came too soon, at once.
        publisher.report({"step": 1001, "total": 1000})
        publisher.flush()
        assert json.loads(client.get(key))["step"] == 1001
        assert 0 < client.ttl(key) <= 60  # it outlives the job, then expires with the result
        done = publisher.published
        publisher.flush()  # nothing new: nothing published
        assert publisher.published == done
    finally:
        task.pop_request()
        client.delete(key)


def test_a_progress_report_of_an_older_attempt_is_refused_counted_and_stops_its_run(client, app):
    """Fencing (issue 39): a cut-off worker's late report, whose job a newer attempt holds,
    writes nothing (neither the PROGRESS state nor the progress key), is counted, and the
    refused attempt's run is to be stopped; the newer attempt's reports go through."""
    task_id = str(uuid.uuid4())
    task = _job_task(app, task_id)
    jobs, key = JobState(client), keys.progress(task_id)
    keeper = LeaseKeeper(client, "cpu9", "w-cpu9", 60)
    try:
        older = keeper.take(task_id, None).attempt
        assert older is not None
        assert publish(task, task.request, {"step": 1}, client=client, expires_s=60, attempt=older, device="cpu9")
        assert json.loads(client.get(key)) == {"step": 1}
        jobs.release(older)
        newer = _lease(jobs, task_id, "cpu9")  # the job given back and taken by a newer attempt
        assert not publish(task, task.request, {"step": 2}, client=client, expires_s=60, attempt=older, device="cpu9")
        assert json.loads(client.get(key)) == {"step": 1}
        result = app.AsyncResult(task_id)
        assert result.state == "PROGRESS" and result.info == {"step": 1}
        assert client.hget(keys.stats("cpu9"), "writes_refused") == "1"
        keeper.superseded(task_id)  # what the worker's relay does with the refusal
        assert keeper.must_stop(task_id) == "its lease was taken by a newer attempt"
        assert publish(task, task.request, {"step": 3}, client=client, expires_s=60, attempt=newer, device="cpu9")
        assert json.loads(client.get(key)) == {"step": 3}
        assert app.AsyncResult(task_id).info == {"step": 3}
    finally:
        task.pop_request()
        client.delete(key)


def test_intermediate_values_ride_along_every_report_so_none_is_folded_away(client, app):
    task_id = str(uuid.uuid4())
    task = _job_task(app, task_id)
    key = keys.progress(task_id)
    try:
        publisher = _throttle(task, client, min_interval_s=60)
        for step in range(1, 301):  # all but the first folded into the last by the throttle
            publisher.report({"step": step, "value": step / 10})
        publisher.report({"epoch": 3})  # a report without a value keeps the pairs too
        publisher.flush()
        report = json.loads(client.get(key))
        assert report["epoch"] == 3
        assert report["values"] == [[s, s / 10] for s in range(301 - VALUES_KEPT, 301)]
        assert "values" not in summary(report)
    finally:
        task.pop_request()
        client.delete(key)


def test_cancelled_context_stops_at_its_next_progress_call(tmp_path):
    cancelled = []
    reports: list[dict[str, object]] = []
    ctx = JobContext(device="cpu0", torch_device="cpu", job_id="j1", artifacts_dir=tmp_path,
                     reporter=reports.append, cancelled=lambda: bool(cancelled))
    ctx.progress(step=1)
    cancelled.append(True)
    with pytest.raises(JobCancelled, match="job j1 on cpu0 was cancelled"):
        ctx.progress(step=2)
    assert reports == [{"step": 1}]
    entry = Entry.make(device="cpu0", worker="w", output=None, error=ErrorInfo.of(JobCancelled("x")),
                       started=None, finished=None)
    assert entry.status is EntryStatus.CANCELLED


# -- the gang rendezvous of distributed jobs (tasks.worker.gang) -------------------------------------


def _gang(gang_id: str, seq: int, devices: list[str], max_restarts: int = 1) -> GangSpec:
    return GangSpec(id=gang_id, devices=devices, seq=seq, backend="gloo", max_restarts=max_restarts,
                    join_timeout_s=10, collective_timeout_s=10)


@pytest.mark.timeout(30)
def test_a_younger_gang_gives_a_device_to_an_older_assembling_gang(client):
    """Queues crossed (the younger gang's rank took d1, the older gang's took d0): the younger
    rank gives d1 up, the older gang assembles; the older rank never gives way to it."""
    older, younger = _gang("older", 1, ["d0", "d1"]), _gang("younger", 2, ["d0", "d1"])
    older_d0 = Rendezvous(client, older, "d0", "h", 60)
    waited: dict[str, Any] = {}
    older_d0.join()
    thread = threading.Thread(target=lambda: waited.update(assembled=older_d0.wait(0)))
    thread.start()
    wait_for(lambda: client.exists(keys.gang_alive("older")), 10, "the older gang to wait")
    younger_d1 = Rendezvous(client, younger, "d1", "h", 60)
    assert younger_d1.join() == 0
    with pytest.raises(GiveWay, match="d1 is needed by the older gang older"):
        younger_d1.wait(0)
    # It left its generation: its gang needs d1 again, and d1 went to the older gang's rank.
    assert client.zscore(keys.device_claims("d1"), "gang:younger") == 2
    older_d1 = Rendezvous(client, older, "d1", "h", 60)
    older_d1.join()
    assert older_d1.wait(0).hosts == {0: "h", 1: "h"}
    thread.join(10)
    assert waited["assembled"].generation == 0
    assert client.zscore(keys.device_claims("d1"), "gang:older") is None


@pytest.mark.timeout(30)
def test_a_gang_of_a_higher_level_wins_a_device_over_an_older_one_in_wait_die(client):
    """The older gang is batch, the younger urgent: the urgent rank waits on, the batch one gives
    its device up (a level goes before age); a normal gang's score is its age, as before."""
    from tasks.core.priority import Level

    older, younger = _gang("old-batch", 1, ["d0", "d1"]), _gang("new-urgent", 2, ["d0", "d1"])
    urgent_d1 = Rendezvous(client, younger, "d1", "h", 60, level=Level.URGENT)
    waited: dict[str, Any] = {}
    assert urgent_d1.join() == 0
    thread = threading.Thread(target=lambda: waited.update(assembled=urgent_d1.wait(0)))
    thread.start()
    wait_for(lambda: client.exists(keys.gang_alive("new-urgent")), 10, "the urgent gang to wait")
    batch_d0 = Rendezvous(client, older, "d0", "h", 60, level=Level.BATCH)
    assert batch_d0.join() == 0
    with pytest.raises(GiveWay, match="d0 is needed by the older gang new-urgent"):
        batch_d0.wait(0)
    urgent_d0 = Rendezvous(client, younger, "d0", "h", 60, level=Level.URGENT)
    urgent_d0.join()
    assert urgent_d0.wait(0).hosts == {0: "h", 1: "h"}
    thread.join(10)
    assert waited["assembled"].generation == 0  # it never gave d1 up to the older batch gang
    assert Rendezvous(client, older, "d0", "h", 60).precedence == 1


@pytest.mark.timeout(30)
def test_a_rank_that_dies_moves_its_gang_on_until_the_restarts_run_out(client):
    spec = _gang("restarts", 3, ["d0", "d1"], max_restarts=1)
    rank0, rank1 = Rendezvous(client, spec, "d0", "h", 60), Rendezvous(client, spec, "d1", "h", 60)
    assert rank0.join() == rank1.join() == 0
    assert rank0.wait(0).generation == 0
    # Rank 1's worker died in generation 0: its fresh run moves the gang to generation 1, and
    # rank 0, whose collective failed, joins it there (the gang moves on once, not twice).
    assert rank1.join() == 1
    assert rank0.join(after=0) == 1
    assert rank0.wait(1).generation == rank1.wait(1).generation == 1
    # One restart allowed: the next death fails the gang, and a waiting peer hears why.
    with pytest.raises(GangFailed, match="gave up after 1 restarts"):
        rank1.join()
    with pytest.raises(GangFailed, match="gave up after 1 restarts"):
        rank0.wait(1)


class _RankWatch:
    """A job's watch that never stops it (the worker's JobWatch, for the gang's loop alone)."""

    def report(self, fields: dict[str, Any]) -> None: ...
    def log(self, lines: Any) -> None: ...
    def heard(self, message: Any) -> None: ...
    def memory(self, used: int) -> None: ...
    preempted: Any = None
    def stop(self) -> None:
        return None
    def act_on(self, stop: Any) -> Any:
        return stop


def _sent(watch: Any) -> Any:
    """The stop the supervisor sends the job now: the watch's, once it acted on it."""
    stop = watch.stop()
    return watch.act_on(stop) if stop is not None else None


def _ended(outcome: Outcome, error: ErrorInfo | None = None) -> Ended:
    return Ended(outcome=outcome, finished=None, error=error, error_module=None, pid=1, retired=None)


class _AskingWatch(_RankWatch):
    """A rank's watch whose worker, once ``asks`` and its rank runs, asks it once to make way for
    urgent work (as JobWatch does when its claim on a waiting message succeeds); ``preempted``:
    the level its rank made way for (its own ask's, or the one its gang's stop names)."""

    def __init__(self, asks: bool) -> None:
        self.asks = asks
        self.running = threading.Event()
        self.preempted: Any = None

    def stop(self) -> Any:
        if self.asks and self.running.is_set() and self.preempted is None:
            from tasks.core.priority import Level

            self.preempted = Level.URGENT
            return StopJob(job_id="j1", reason=StopReason.PREEMPT, message="make way", grace_s=1.0)
        return None


@pytest.mark.timeout(30)
def test_a_gang_makes_way_as_a_whole_and_the_generation_it_ended_is_no_restart(client, caplog):
    """Rank 0's worker asks its rank to make way: the gang is marked first, every rank stops
    (rank 1 told by the mark), each goes back to its queue; run again, they assemble in the next
    generation though the gang has no restart to spend."""
    from tasks.core.defaults import PREEMPT_GRACE_S
    from tasks.core.priority import Level

    spec = _gang("preempted", 4, ["d0", "d1"], max_restarts=0)
    job = RunJob(job_id="j1", job="ranked", kwargs={}, fan_out_id="f1")
    watches = [_AskingWatch(asks=True), _AskingWatch(asks=False)]
    generations: dict[int, list[int]] = {0: [], 1: []}
    stops: dict[int, Any] = {}

    def run(message: RunJob, watch: Any) -> Ended:
        rank = message.rank
        assert rank is not None
        generations[rank.rank].append(rank.generation)
        if rank.rank == 0:
            watch.heard(StoreOpened(port=1234))
        if watches[rank.rank].preempted is not None:  # its second run: to its end
            return _ended(Outcome.OK)
        watches[rank.rank].running.set()
        deadline = time.monotonic() + 10
        while (stop := _sent(watch)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        stops[rank.rank] = stop
        if stop is not None:
            watches[rank.rank].preempted = watches[rank.rank].preempted or stop.level
        return _ended(Outcome.OK if stop is None else Outcome.PREEMPTED)

    def both() -> dict[int, Ended]:
        ended: dict[int, Ended] = {}
        threads = [threading.Thread(target=lambda i=i: ended.update(
            {i: gang_module.run_rank(client, spec, f"d{i}", "h", 60, job, watches[i], run)})) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        return ended

    caplog.set_level(logging.INFO, logger=gang_module.__name__)
    ended = both()
    assert {i: e.outcome for i, e in ended.items()} == {0: Outcome.PREEMPTED, 1: Outcome.PREEMPTED}
    # Each rank's gang watch said it made way as a whole, though rank 1's worker did not ask it.
    made_way = {r.args[1] for r in caplog.records if "its gang makes way for" in r.msg and r.args[2] == "urgent"}
    assert made_way == {"d0", "d1"}
    assert {i: (stop.reason, stop.grace_s) for i, stop in stops.items()} == {
        0: (StopReason.PREEMPT, PREEMPT_GRACE_S), 1: (StopReason.PREEMPT, PREEMPT_GRACE_S)}
    assert [watch.preempted for watch in watches] == [Level.URGENT, Level.URGENT]
    assert client.hmget(keys.gang("preempted"), ["preempt", "preempted", "failed"]) == ["0:urgent", "1", None]
    # Their messages came back: the gang assembles in generation 1 and runs to its end.
    ended = both()
    assert {i: e.outcome for i, e in ended.items()} == {0: Outcome.OK, 1: Outcome.OK}
    assert generations == {0: [0, 1], 1: [0, 1]}
    assert client.hget(keys.gang("preempted"), "failed") is None


@pytest.mark.timeout(30)
def test_one_restart_loop_runs_a_rank_again_in_the_next_generation_until_the_budget_is_spent(client):
    """The worker's gang (tasks.worker.gang.run_rank) hands each run its Rank; a lost peer or a
    crashed process runs the rank again one generation on; a crash with no restart left fails
    the gang naming it, and the rank's entry keeps the crash."""
    job = RunJob(job_id="j1", job="ranked", kwargs={}, fan_out_id="f1")
    runs: list[Any] = []
    outcomes = iter([_ended(Outcome.PEER_LOST), _ended(Outcome.ERROR, ErrorInfo(type="JobCrashed", message="boom")),
                     _ended(Outcome.OK)])

    def run(message: RunJob, watch: Any) -> Ended:
        runs.append(message.rank)
        return next(outcomes)

    ended = gang_module.run_rank(client, _gang("loop", 1, ["d0"], max_restarts=2), "d0", "10.0.0.7", 60, job,
                                 _RankWatch(), run)
    assert ended.outcome is Outcome.OK
    assert [r.generation for r in runs] == [0, 1, 2]
    assert {(r.rank, r.world_size, r.master_addr, r.master_port) for r in runs} == {(0, 1, "10.0.0.7", None)}

    crashes = iter([_ended(Outcome.ERROR, ErrorInfo(type="JobCrashed", message="killed by SIGKILL"))])
    ended = gang_module.run_rank(client, _gang("spent", 2, ["d0"], max_restarts=0), "d0", "h", 60, job,
                                 _RankWatch(), lambda message, watch: next(crashes))
    assert ended.error is not None and ended.error.type == "JobCrashed"
    assert "rank 0 on d0 failed: JobCrashed: killed by SIGKILL" in client.hget(keys.gang("spent"), "failed")


@pytest.mark.timeout(30)
def test_a_rank_its_worker_fenced_off_leaves_its_gang_to_its_peers(client):
    """A rank whose worker stopped it cut off from Redis (self-fencing) does not fail its gang
    once Redis is back: its peers moved the gang on from its lease, and its next run joins them."""

    ran: list[Any] = []

    class FencedWatch(_RankWatch):
        def stop(self) -> Any:
            return StopJob(job_id="j1", reason=StopReason.FENCED, message="cut off") if ran else None

    def run(message: RunJob, watch: Any) -> Ended:
        ran.append(message.rank)
        return stopped

    job = RunJob(job_id="j1", job="ranked", kwargs={}, fan_out_id="f1")
    # As the supervisor ends a run it sent the fencing stop (the stop travels into its Ended).
    stopped = Ended.by_worker(WorkerStopped, "cut off", pid=1, retired=None).under(
        StopJob(job_id="j1", reason=StopReason.FENCED, message="cut off"))
    ended = gang_module.run_rank(client, _gang("fenced", 7, ["d0"]), "d0", "h", 60, job, FencedWatch(), run)
    assert ended is stopped and len(ran) == 1
    assert client.hget(keys.gang("fenced"), "failed") is None
    # Stopped so before a generation starts: the same.
    ended = gang_module.run_rank(client, _gang("fenced-early", 8, ["d0"]), "d0", "h", 60, job, FencedWatch(), run)
    assert ended.error is not None and ended.error.type == "WorkerStopped" and len(ran) == 1
    assert client.hget(keys.gang("fenced-early"), "failed") is None


def _ranks_under_leases(client: Any, spec: GangSpec) -> tuple[JobState, dict[str, Any], list[Rendezvous]]:
    """Each rank of ``spec`` under a lease of its own, joined and assembled in generation 0."""
    jobs = JobState(client)
    attempts = {d: _lease(jobs, f"{spec.id}-{d}", d) for d in spec.devices}
    ranks = [Rendezvous(client, spec, d, "h", 60, task_id=f"{spec.id}-{d}", token=attempts[d].token)
             for d in spec.devices]
    for rank in ranks:
        assert rank.join() == 0
    assert ranks[0].wait(0).generation == 0
    return jobs, attempts, ranks


def _lease(jobs: JobState, task_id: str, device: str) -> Any:
    reply = jobs.take(LeaseRecord(device=device, worker=f"w-{device}", pid=1, host="h", task_id=task_id,
                                  since=time.time()), 60_000)
    assert reply.attempt is not None
    return reply.attempt


@pytest.mark.timeout(30)
def test_a_ranks_watch_moves_its_gang_on_once_a_peers_lease_is_gone_or_newer(client):
    """Issue 39, gangs: a rank learns from the fleet that a peer is lost (its lease expired,
    or a newer attempt of its job holds it), not from a collective that cannot complete, and
    moves the gang on (a restart; the gang fails once its restarts are spent)."""
    spec = _gang("watched", 5, ["d0", "d1"], max_restarts=1)
    jobs, attempts, (rank0, rank1) = _ranks_under_leases(client, spec)
    watch = GangWatch(_RankWatch(), rank0, "watched-d0", 0, "h", jobs)
    try:
        assert watch.look() is None  # every peer holds its lease
        client.delete(keys.lease("watched-d1"))  # rank 1's lease expired: its host is cut off
        stop = wait_for(watch.stop, 10, "rank 0's watch to see rank 1's lease go", poll=0.05)
    finally:
        watch.close()
    assert stop.reason is StopReason.GANG
    assert stop.message == ("watched moved on from generation 0 to 1 (rank 1 on d1 lost its lease (its worker "
                            "is cut off from Redis, or died))")
    assert rank0.state() == (None, 1)
    # Generation 1: rank 1's job given back and taken by a newer attempt, both joined again.
    jobs.release(attempts["d1"])
    newer = _lease(jobs, "watched-d1", "d1")
    rank1 = Rendezvous(client, spec, "d1", "h", 60, task_id="watched-d1", token=newer.token)
    assert rank0.join(after=0) == rank1.join() == 1
    watch = GangWatch(_RankWatch(), rank0, "watched-d0", 1, "h", jobs)
    watch.close()
    assert watch.look() is None
    # Taken by a newer attempt again while generation 1 runs: no restart is left, the gang fails.
    jobs.release(newer)
    newest = _lease(jobs, "watched-d1", "d1")
    stop = watch.look()
    assert stop is not None and stop.reason is StopReason.GANG
    assert stop.message == (f"distributed job watched: gave up after 1 restarts (rank 1 on d1: a newer attempt "
                            f"(token {newest.token}) holds its job)")
    assert rank0.state()[0] == stop.message.removeprefix("distributed job watched: ")


@pytest.mark.timeout(30)
def test_a_peer_that_ended_ok_is_not_lost_when_its_lease_goes_with_its_result(client):
    spec = _gang("finishing", 6, ["d0", "d1"])
    jobs, attempts, (rank0, rank1) = _ranks_under_leases(client, spec)
    rank1.done()
    jobs.release(attempts["d1"])  # as the store of its result does
    watch = GangWatch(_RankWatch(), rank0, "finishing-d0", 0, "h", jobs)
    watch.close()
    assert watch.look() is None
    assert rank0.state() == (None, 0)


def test_peer_lost_tells_a_lost_collective_from_a_jobs_own_error():
    import torch.distributed as dist

    assert peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert peer_lost(dist.DistNetworkError("store"))
    assert peer_lost(PeerLost("the gang moved on while this rank joined its group"))
    assert not peer_lost(ValueError("bad value"))
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# -- bounded attempts: a job that takes its worker down -----------------------------------------


def _held_by_dead(client, task_id: str, pid: int, *, key: bool = True) -> LeaseRecord:  # type: ignore[no-untyped-def]
    """The lease of a worker (cpu5 on another host, not in the registry: dead) that died running
    ``task_id``: its key still there (``key``), or expired with its record left in the hash."""
    record = LeaseRecord(device="cpu5", worker=f"cpu5@{OTHER_HOST}", pid=pid, host=OTHER_HOST,
                         task_id=task_id, since=time.time(), resend=NOOP_RESEND)
    if key:
        client.set(keys.lease(task_id), record.to_json(), px=60_000)
    client.hset(keys.LEASES, task_id, record.to_json())
    return record


def _deaths(client, task_id: str) -> list[str]:  # type: ignore[no-untyped-def]
    return client.lrange(keys.worker_deaths(task_id), 0, -1)


@pytest.mark.parametrize("key", [True, False], ids=["lease key held", "lease key expired"])
def test_taking_over_a_dead_owners_lease_counts_its_death(client, key):
    task_id = str(uuid.uuid4())
    _held_by_dead(client, task_id, pid=4_000_001, key=key)
    successor = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    assert successor.take(task_id, "tag-b", keep_s=60).outcome is Take.TAKEN
    assert _deaths(client, task_id) == [f"cpu5@{OTHER_HOST} pid 4000001"]
    assert 0 < client.ttl(keys.worker_deaths(task_id)) <= 60
    assert lease_of(client, task_id).device == "cpu2"  # type: ignore[union-attr]
    assert client.hget(keys.LEASES, task_id) == client.get(keys.lease(task_id))


def test_copies_of_a_job_whose_worker_lives_count_no_death(client, app, monkeypatch):
    # A copy refused by the live owner (a visibility-timeout restore), whose key expired or not.
    task_id = str(uuid.uuid4())
    owner = LeaseKeeper(client, "cpu1", f"cpu1@{OTHER_HOST}", ttl_s=5.0)
    with on_other_host(monkeypatch):
        assert owner.take(task_id, "tag-a").outcome is Take.TAKEN
    register(client, worker_record("cpu1", host=OTHER_HOST))
    copy = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    assert copy.take(task_id, "tag-b", max_attempts=1).outcome is Take.RUNNING_ELSEWHERE
    client.delete(keys.lease(task_id))  # late to renew: the reaper leaves it alone, and so does a copy
    assert copy.take(task_id, "tag-b", max_attempts=1).outcome is Take.RUNNING_ELSEWHERE
    assert reap_once(client, app) == []
    # A lease this process left behind (its release failed), taken again.
    mine = LeaseKeeper(client, "cpu3", "cpu3@here", ttl_s=5.0)
    left = str(uuid.uuid4())
    assert mine.take(left, None).outcome is Take.TAKEN
    with mine._lock:
        mine._held.clear()  # as if the release had happened here but not in Redis
    assert mine.take(left, None, max_attempts=1).outcome is Take.TAKEN
    # Sent again after its lease was released (a distributed rank giving way retries so).
    mine.release(left)
    assert mine.take(left, None, max_attempts=1).outcome is Take.TAKEN
    assert _deaths(client, task_id) == [] and _deaths(client, left) == []


def test_the_reaper_counts_the_death_of_the_owner_it_gives_a_job_back_from(client, app, monkeypatch):
    task_id = str(uuid.uuid4())
    record = _dead_lease(client, task_id, resend=NOOP_RESEND)
    assert reap_once(client, app) == [task_id]
    assert _deaths(client, task_id) == [f"{record.worker} pid {record.pid}"]
    assert client.ttl(keys.worker_deaths(task_id)) > 0  # kept as long as the results

    # A worker that takes the given-back job over before the reaper's count is done counts the
    # death itself: once, not twice.
    raced = str(uuid.uuid4())
    _dead_lease(client, raced, resend=NOOP_RESEND)
    successor = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    taken: list[Take] = []
    real_resend = reaper_module.resend_job

    def resend_and_taken_at_once(*args: Any) -> None:
        real_resend(*args)
        taken.append(successor.take(raced, None).outcome)

    monkeypatch.setattr(reaper_module, "resend_job", resend_and_taken_at_once)
    assert reap_once(client, app) == [raced]
    assert taken == [Take.TAKEN]
    assert len(_deaths(client, raced)) == 1
    assert client.hget(keys.LEASES, raced) == client.get(keys.lease(raced))  # the successor's, kept


def test_a_copy_whose_dead_owner_the_reaper_gives_back_meanwhile_runs_the_job(client, app, monkeypatch):
    # The reaper's given-back copy reached a worker at once: the worker read the dead owner's
    # expired lease, and the reaper counted the death and cleared the lease before the worker's
    # take-over. The copy takes the job (it is the one given back: dropping it would lose the
    # job) and the death is counted once.
    task_id = str(uuid.uuid4())
    _dead_lease(client, task_id, resend=NOOP_RESEND)
    successor = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    real_owner_alive = lease_module.owner_alive
    reaped: list[list[str]] = []

    def reaped_meanwhile(c: Any, lease: LeaseRecord) -> bool:
        if not reaped:  # the worker's check of the owner; the reaper's own goes through
            reaped.append([])
            reaped[0] = reap_once(client, app)
        return real_owner_alive(c, lease)

    monkeypatch.setattr(lease_module, "owner_alive", reaped_meanwhile)
    assert successor.take(task_id, None).outcome is Take.TAKEN
    assert reaped == [[task_id]]
    assert len(_deaths(client, task_id)) == 1
    assert client.hget(keys.LEASES, task_id) == client.get(keys.lease(task_id))  # the successor's
    successor.release(task_id)


def test_a_job_that_took_its_worker_down_max_attempts_times_is_not_run_again(client):
    task_id = str(uuid.uuid4())
    keeper = LeaseKeeper(client, "cpu2", "cpu2@here", ttl_s=5.0)
    _held_by_dead(client, task_id, pid=4_000_001)
    assert keeper.take(task_id, None, max_attempts=2).outcome is Take.TAKEN  # 1 death of 2
    keeper.release(task_id)
    _held_by_dead(client, task_id, pid=4_000_002)
    lost = keeper.take(task_id, None, max_attempts=2)
    assert lost.outcome is Take.LOST
    assert lost.lost_to == (f"cpu5@{OTHER_HOST} pid 4000001", f"cpu5@{OTHER_HOST} pid 4000002")
    # The lease is the refusing worker's, to be released with the stored failure: a copy
    # arriving meanwhile is dropped.
    assert keeper.held() == [task_id] and lease_of(client, task_id).device == "cpu2"  # type: ignore[union-attr]
    keeper.release(task_id)
    # Given back by the reaper (no lease left to take over): refused all the same.
    assert keeper.take(task_id, None, max_attempts=2).outcome is Take.LOST
    keeper.release(task_id)
    assert keeper.take(task_id, None, max_attempts=3).outcome is Take.TAKEN  # a higher bound runs it
    keeper.release(task_id)
    assert len(_deaths(client, task_id)) == 2


def test_hold_ends_a_lost_job_as_worker_lost_and_keeps_a_dead_letter(client, app, redis_server):
    keeper = LeaseKeeper(client, "cpu9", "cpu9@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    for pid in (4_000_001, 4_000_002):
        client.rpush(keys.worker_deaths(task_id), f"cpu9@{OTHER_HOST} pid {pid}")
    task = _job_task(app, task_id)
    try:
        with pytest.raises(WorkerLost) as lost, held_lease(keeper, task, max_attempts=2):
            pytest.fail("a job that took its worker down max_attempts times ran again")
    finally:
        task.pop_request()
    message = str(lost.value)
    assert f"job {task_id} (components.job) took its worker down 2 times" in message
    assert f"cpu9@{OTHER_HOST} pid 4000001, cpu9@{OTHER_HOST} pid 4000002" in message
    assert "max_attempts=2" in message
    assert keeper.held() == [task_id]  # the failure's store releases it (runner.execute)
    keeper.release(task_id)
    assert client.get(app.backend.get_key_for_task(task_id)) is None  # not STARTED: it never ran

    letters = tasks.dead_letters(app)
    assert [(d.task_id, d.job, d.device, d.queue, d.kwargs, d.max_attempts) for d in letters] == [
        (task_id, "components.job", "cpu9", "device.cpu9", {"epochs": 1}, 2)]
    assert letters[0].workers == [f"cpu9@{OTHER_HOST} pid 4000001", f"cpu9@{OTHER_HOST} pid 4000002"]
    rep = report(redis_server.url)
    assert [d["task_id"] for d in rep["dead_letters"]] == [task_id]
    out = io.StringIO()
    Console(file=out, width=200).print(render(rep))
    assert "1 dead letter(s)" in out.getvalue() and task_id in out.getvalue()
    assert fleet_snapshot(client)["dead_letters"] == 1

    assert tasks.forget_dead_letter(task_id, app=app)
    assert tasks.dead_letters(app) == [] and _deaths(client, task_id) == []
    assert not tasks.forget_dead_letter(task_id, app=app)
    assert report(redis_server.url)["dead_letters"] == []


# -- a message popped while Redis goes away -------------------------------------------------------


def test_a_message_popped_as_redis_goes_away_goes_back_to_its_queue(client, app, monkeypatch):
    """kombu pops a message (BRPOP), then records it in its unacked hash (a second round trip).
    When Redis goes away between the two (a Sentinel failover), the message is in no queue and no
    unacked hash; the transport keeps it and the next BRPOP, on a new connection, gives it back."""
    import redis as redis_py
    from kombu import Consumer, Queue
    from kombu.transport import redis as kombu_redis

    from tasks.core import transport

    queue = Queue("popped-test", Exchange(""), routing_key="popped-test")
    with app.producer_or_acquire() as producer:
        producer.publish({"n": 1}, exchange=Exchange(""), routing_key="popped-test", declare=[queue])
    assert client.llen("popped-test") == 1
    real_append = kombu_redis.QoS.append
    fails = [redis_py.ConnectionError("Redis went away after BRPOP (test)")]

    def append(self, message, delivery_tag):  # type: ignore[no-untyped-def]
        if fails:
            raise fails.pop()
        real_append(self, message, delivery_tag)

    monkeypatch.setattr(kombu_redis.QoS, "append", append)
    got: list[Any] = []
    with app.connection_for_read() as conn:
        with Consumer(conn, [queue], callbacks=[lambda body, message: got.append((body, message))]):
            with pytest.raises(redis_py.ConnectionError):
                conn.drain_events(timeout=5)
    # Popped and not recorded: without the transport's copy it would be lost for good.
    assert got == [] and client.llen("popped-test") == 0 and len(transport.POPPED) == 1
    with app.connection_for_read() as conn:  # the consumer's reconnect
        with Consumer(conn, [queue], callbacks=[lambda body, message: got.append((body, message))]):
            conn.drain_events(timeout=5)
            assert [body for body, _ in got] == [{"n": 1}] and not transport.POPPED
            message = got[0][1]
            assert message.delivery_info.get("redelivered") or message.headers.get("redelivered")
            assert client.hexists(conn.default_channel.qos.unacked_key, message.delivery_tag)
            message.ack()
    assert client.llen("popped-test") == 0
