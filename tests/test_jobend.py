"""A job's end: its record (JobEnd, JobCount), its one builder, its one seam, and the store
script that reads it. In-process; the scripts run on an embedded redis-server."""

from __future__ import annotations

import ast
import json
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context

from tasks.core import keys
from tasks.core.app import FleetCelery, create_app
from tasks.core.defaults import FINISHED_KEEP_S
from tasks.core.devices import format_core_list
from tasks.core.job import JobMetric
from tasks.core.jobcount import JOBS_ERROR, JOBS_OK, SCRIPT_FIELDS, DeviceStats, JobCount, Tally
from tasks.core.jobscripts import STORE, TAKE, StoreArgs, StoreKeys, TakeArgs, TakeKeys
from tasks.core.jobstate import (
    END_FIELD,
    Attempt,
    JobEnd,
    JobState,
    MessageAck,
    StateMeta,
    Stored,
    Took,
    hand_over,
    handover,
    stamp_lease,
)
from tasks.core.records import LeaseRecord
from tasks.core.settings import Settings
from tasks.core.transport import stored_ack_keys
from tasks.ops.exporter import fleet_snapshot
from tasks.ops.redis_server import EmbeddedRedis
from tasks.worker.accounting import job_end
from tasks.worker.lease import LeaseKeeper, Take

pytestmark = pytest.mark.timeout(60)

TASKS = Path(__file__).resolve().parent.parent / "tasks"


@pytest.fixture(scope="module")
def app(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetCelery]:
    settings = Settings.load(redis_url=redis_server.url, state_dir=tmp_path_factory.mktemp("jobend-state"),
                             cores=format_core_list(sorted(os.sched_getaffinity(0))))
    celery_app = create_app(settings, main="devicefleet-jobend")
    yield celery_app
    celery_app.close()


def calls(client) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Redis commands run since the last CONFIG RESETSTAT, by name (this test's own left out)."""
    return {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in client.info("commandstats").items()
            if not name.startswith(("cmdstat_config", "cmdstat_info"))}


# -- the count: one record for the writer, the script and the reader --------------------------------


def test_the_store_script_reads_exactly_the_fields_the_count_sends():
    count = JobCount(device="cpu0", ok=True, worker="cpu0@h", busy_seconds=1.5, last_finished_at=10.0)
    sent = json.loads(count.script_arg())
    read = set(re.findall(r"\bcount\.(\w+)", STORE))
    assert tuple(sent) == SCRIPT_FIELDS
    assert read == set(SCRIPT_FIELDS)
    # The two tallies are the two tables the script walks (HINCRBYFLOAT, HSET).
    assert {Tally.ADD.value, Tally.LATEST.value} <= read
    assert "pairs(count.add)" in STORE and "pairs(count.set)" in STORE


#: Lua's reserved words: no field of a script's record may be one (``key.end`` does not parse).
LUA_WORDS = set("and break do else elseif end false for function goto if in local nil not or repeat return then "
                "true until while".split())


@pytest.mark.parametrize(("script", "records"), [(TAKE, (TakeKeys, TakeArgs)), (STORE, (StoreKeys, StoreArgs))],
                         ids=["take", "store"])
def test_the_take_and_store_scripts_read_their_keys_and_arguments_by_their_records_field_names(script, records):
    """The order of TAKE's and STORE's KEYS and ARGV comes from one record each: the caller passes
    its fields' values in order, the script declares one table from the same fields and reads
    every key and argument from it by name, never by position."""
    body = script[script.index("local arg = {"):].partition("\n")[2]
    assert "KEYS[" not in body and "ARGV[" not in body
    for table, array, record in (("key", "KEYS", records[0]), ("arg", "ARGV", records[1])):
        names = [field.name for field in fields(record)]
        declared = ", ".join(f"{name} = {array}[{n}]" for n, name in enumerate(names, 1))
        assert f"local {table} = {{{declared}}}\n" in script
        assert set(re.findall(rf"\b{table}\.(\w+)", body)) == set(names), record.__name__
        assert not set(names) & LUA_WORDS
        assert record(**{name: name for name in names}).values() == names


def test_the_reader_reads_every_field_the_count_tallies_by_the_same_name():
    tallied = {f.name for f in fields(JobCount) if "tally" in f.metadata}
    read = {f.name for f in fields(DeviceStats) if "read" in f.metadata}
    assert read == tallied | {JOBS_OK, JOBS_ERROR}


def test_a_counts_figures_as_the_script_gets_them():
    count = JobCount(device="gpu0", ok=False, worker="gpu0@h", busy_seconds=2.25, last_finished_at=1000.5,
                     gpu_memory_bytes=2**30,
                     metrics={JobMetric.SAMPLES: 64, JobMetric.SAMPLES_PER_S: 12.5, JobMetric.DATA_WAIT_FRACTION: 0.1})
    assert json.loads(count.script_arg()) == {
        "device": "gpu0", "outcome": JOBS_ERROR,
        "add": {"busy_seconds": "2.25", "samples": "64.0"},
        "set": {"worker": "gpu0@h", "last_finished_at": "1000.5", "gpu_memory_bytes": str(2**30),
                "last_samples_per_s": "12.5", "last_data_wait_fraction": "0.1"},
        "finished": "1000.5", "keep_after": repr(1000.5 - FINISHED_KEEP_S),
        "share": {}, "wait": {},  # no user, no send time: nothing for the fair share
    }
    # A figure not measured is not written (the device keeps its last one).
    bare = json.loads(JobCount(device="cpu0", ok=True, worker="w", busy_seconds=0.0, last_finished_at=1.0).script_arg())
    assert bare["outcome"] == JOBS_OK and "gpu_memory_bytes" not in bare["set"]


def test_counts_stored_by_the_script_read_back_as_device_stats(client):
    jobs = JobState(client)
    first = JobCount(device="cpu7", ok=True, worker="cpu7@a", busy_seconds=1.5, last_finished_at=100.0,
                     metrics={JobMetric.SAMPLES: 10, JobMetric.SAMPLES_PER_S: 4.0})
    second = JobCount(device="cpu7", ok=False, worker="cpu7@b", busy_seconds=0.5, last_finished_at=101.0,
                      gpu_memory_bytes=123, metrics={JobMetric.SAMPLES: 5, JobMetric.DATA_WAIT_FRACTION: 0.25})
    for n, count in enumerate((first, second)):
        meta = StateMeta(key=f"meta-{n}", value=json.dumps({"status": "SUCCESS"}), expires_s=0)
        assert jobs.finish(f"task-{n}", meta, JobEnd(count=count), final=True) is Stored.STORED
    stats = DeviceStats.parse(client.hgetall(keys.stats("cpu7")))
    assert stats == DeviceStats(jobs_ok=1, jobs_error=1, worker="cpu7@b", busy_seconds=2.0, last_finished_at=101.0,
                                gpu_memory_bytes=123, counters={JobMetric.SAMPLES: 15.0},
                                gauges={JobMetric.SAMPLES_PER_S: 4.0, JobMetric.DATA_WAIT_FRACTION: 0.25})
    assert stats.jobs_total == 2
    assert client.smembers(keys.STATS_DEVICES) == {"cpu7"}
    assert client.zrange(keys.finished("cpu7"), 0, -1, withscores=True) == [("task-0", 100.0), ("task-1", 101.0)]
    assert DeviceStats.parse({}) == DeviceStats()
    # What the exporter makes of them (no worker of cpu7 is live: it has run jobs).
    snap = fleet_snapshot(client)["devices"]["cpu7"]
    assert {k: snap[k] for k in ("live", "worker", "jobs_ok", "jobs_error", "jobs_total", "busy_seconds", "samples",
                                 "samples_per_s", "data_wait_fraction", "gpu_memory_bytes")} == {
        "live": False, "worker": "cpu7@b", "jobs_ok": 1, "jobs_error": 1, "jobs_total": 2, "busy_seconds": 2.0,
        "samples": 15, "samples_per_s": 4.0, "data_wait_fraction": 0.25, "gpu_memory_bytes": 123.0}


# -- the interface: one script call a step, an attempt the handle --------------------------------------


def _record(task_id: str, device: str = "cpu0") -> LeaseRecord:
    return LeaseRecord(device=device, worker=f"{device}@here", pid=os.getpid(), host="here", task_id=task_id,
                       since=1.0)


def test_take_returns_the_attempt_that_renew_release_and_finish_take(client):
    jobs = JobState(client)
    task_id = str(uuid.uuid4())
    taken = jobs.take(_record(task_id), 5000)
    assert taken.status is Took.OK and taken.attempt == Attempt(task_id, stamp_lease(_record(task_id).to_json(), 1), 1)
    attempt = taken.attempt
    assert client.get(keys.lease(task_id)) == attempt.lease == client.hget(keys.LEASES, task_id)

    other = jobs.take(_record(task_id, device="cpu1"), 5000)
    assert other.status is Took.HELD and other.attempt is None and other.holder == attempt.lease

    client.pexpire(keys.lease(task_id), 100)
    assert jobs.renew(attempt, 5000, restore=False) and client.pttl(keys.lease(task_id)) > 100
    assert jobs.expired() == {}
    jobs.release(attempt)
    assert client.exists(keys.lease(task_id)) == 0 and not client.hexists(keys.LEASES, task_id)

    # A successor's lease is left alone by a stale attempt: renew says so, release and the
    # store of the stale end do not touch it. (Fencing, issue 39: the stale end's store is
    # refused, where it used to be stored; the successor's is then the one stored.)
    successor = jobs.take(_record(task_id, device="cpu2"), 5000).attempt
    assert successor is not None and successor.token == 2
    assert not jobs.renew(attempt, 5000, restore=True)
    assert not jobs.release(attempt)
    meta = StateMeta(key="meta", value=json.dumps({"status": "SUCCESS"}), expires_s=0)
    assert jobs.finish(task_id, meta, JobEnd(attempt=attempt), final=True) is Stored.FENCED
    assert client.get("meta") is None
    assert client.get(keys.lease(task_id)) == successor.lease
    assert jobs.finish(task_id, meta, JobEnd(attempt=successor), final=True) is Stored.STORED
    assert jobs.finish(task_id, meta, JobEnd(attempt=successor), final=True) is Stored.FINAL_THERE
    assert client.exists(keys.lease(task_id)) == 0  # released all the same


def test_a_jobs_end_is_one_round_trip_and_acknowledges_its_message(client):
    jobs = JobState(client)
    task_id = str(uuid.uuid4())
    attempt = jobs.take(_record(task_id), 5000).attempt
    assert attempt is not None
    client.hset("unacked", "tag-1", "message")
    client.zadd("unacked_index", {"tag-1": 1.0})
    end = JobEnd(attempt=attempt, ack=MessageAck(unacked_key="unacked", unacked_index_key="unacked_index",
                                                 delivery_tag="tag-1"),
                 count=JobCount(device="cpu0", ok=True, worker="cpu0@here", busy_seconds=1.0, last_finished_at=5.0))
    meta = StateMeta(key="meta", value=json.dumps({"status": "SUCCESS"}), expires_s=0)
    jobs.finish(task_id, meta, JobEnd(), final=True)  # loads the script
    client.delete("meta")
    client.config_resetstat()
    assert jobs.finish(task_id, meta, end, final=True) is Stored.STORED
    # One round trip; inside it, "get" 3: the meta, the lease, and the job's fencing token; "del" 2:
    # the lease, and the device's window of fast failures (a job ended ok: it is no black hole).
    assert calls(client) == {"evalsha": 1, "get": 3, "hget": 1, "set": 1, "publish": 1, "del": 2, "hdel": 2,
                             "zrem": 1, "sadd": 1, "hincrby": 1, "hincrbyfloat": 1, "hset": 2, "zadd": 1,
                             "zremrangebyscore": 1}
    assert not client.hexists("unacked", "tag-1") and client.zcard("unacked_index") == 0
    assert client.exists(keys.lease(task_id)) == 0


# -- the builder: every path's end ------------------------------------------------------------------


def _worker(leases: LeaseKeeper) -> Any:
    return SimpleNamespace(leases=leases, device=SimpleNamespace(name="cpu3"), nodename="cpu3@here")


def test_the_builder_hands_the_held_attempt_the_count_and_the_messages_ack(client, app):
    keeper = LeaseKeeper(client, "cpu3", "cpu3@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    taken = keeper.take(task_id, "tag-9")
    request = Context(id=task_id, properties={"delivery_tag": "tag-9"})
    end = job_end(_worker(keeper), app, request, ok=True, started=10.0, finished=12.5,
                  metrics={JobMetric.SAMPLES: 3}, gpu_memory_bytes=7)
    assert end == JobEnd(
        attempt=taken.attempt,
        count=JobCount(device="cpu3", ok=True, worker="cpu3@here", busy_seconds=2.5, last_finished_at=12.5,
                       gpu_memory_bytes=7, metrics={JobMetric.SAMPLES: 3}),
        ack=MessageAck(unacked_key="unacked", unacked_index_key="unacked_index", delivery_tag="tag-9"),
    )
    # Not held here (refused before its take: invalid options), and no message (an unknown
    # job's, rejected already): counted, nothing else.
    refused = job_end(_worker(keeper), app, Context(id="another"), ok=False, started=1.0, finished=0.5)
    assert refused.attempt is None and refused.ack is None
    assert refused.count is not None and not refused.count.ok and refused.count.busy_seconds == 0.0
    keeper.release(task_id)


def test_a_script_acknowledges_only_on_the_fleets_transport_without_a_key_prefix(app):
    assert stored_ack_keys(app.conf) == ("unacked", "unacked_index")
    conf = SimpleNamespace(broker_transport=app.conf.broker_transport,
                           broker_transport_options={"unacked_key": "u", "unacked_index_key": "ui"})
    assert stored_ack_keys(conf) == ("u", "ui")
    conf.broker_transport_options = {"global_keyprefix": "x:"}
    assert stored_ack_keys(conf) is None
    assert stored_ack_keys(SimpleNamespace(broker_transport="redis", broker_transport_options={})) is None


# -- the seam: the request's one field, and what the store did ---------------------------------------


def test_the_store_takes_the_end_from_the_request_and_the_keeper_settles_without_a_round_trip(client, app):
    keeper = LeaseKeeper(client, "cpu3", "cpu3@here", ttl_s=5.0)
    task_id = str(uuid.uuid4())
    assert keeper.take(task_id, None).outcome is Take.TAKEN
    request = Context(id=task_id)
    assert handover(request) is None and handover(None) is None
    handed = hand_over(request, JobEnd(attempt=keeper.finishing(task_id)))
    assert handover(request) is handed and handed.stored is None
    app.backend.store_result(task_id, {"done": True}, "SUCCESS", request=request)
    assert handed.stored is Stored.STORED
    assert client.exists(keys.lease(task_id)) == 0
    client.config_resetstat()
    keeper.settle(task_id, request)
    assert keeper.held() == [] and calls(client) == {}

    # A store that never came (it failed), or stored no end (a retry): the lease is released.
    for stored_state in (None, "RETRY"):
        again = str(uuid.uuid4())
        assert keeper.take(again, None).outcome is Take.TAKEN
        retried = Context(id=again)
        hand_over(retried, JobEnd(attempt=keeper.finishing(again)))
        if stored_state is not None:
            app.backend.store_result(again, None, stored_state, request=retried)
        keeper.settle(again, retried)
        assert keeper.held() == [] and client.exists(keys.lease(again)) == 0


def test_only_the_job_state_module_touches_the_seam_and_only_the_builder_makes_an_end():
    """The end's field is named in tasks/core/jobstate.py only; JobEnd and JobCount are built by
    the builder (tasks/worker/accounting.py) only, outside the module that defines them."""
    named: list[str] = []
    built: list[str] = []
    for path in sorted(TASKS.rglob("*.py")):
        relative = str(path.relative_to(TASKS.parent))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == END_FIELD:
                named.append(relative)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("JobEnd", "JobCount"):
                built.append(relative)
    assert named == ["tasks/core/jobstate.py"]
    assert set(built) <= {"tasks/worker/accounting.py", "tasks/core/jobstate.py"}
    assert "tasks/worker/accounting.py" in built
