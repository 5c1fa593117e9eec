"""Nothing lost: worker death, Redis restart, out-of-memory, bad input, load, security doors.

These tests run their own fleet (two CPU workers on an embedded Redis, supervised as
``devicefleet up`` supervises them) with short leases, because they kill workers and restart
Redis under it. The figures in the README's reliability table come from here.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from click.testing import CliRunner
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from kombu import Exchange
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads as kombu_loads

import tasks
from tasks import Fleet, fan_out
from tasks.cli import cli
from tasks.core.errors import ConfigError, DeviceUnavailable
from tasks.producer.fanout import JobSpec
from tasks.lease import LEASES_KEY, REAPER_STATS
from tasks.runner import RUN_JOB

from .conftest import TEST_JOB_MODULES, make_settings, wait_for
from .conftest import test_env as child_env

LEASE_TTL_S = 4.0
RECOVERY_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def rfleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    settings = make_settings(
        tmp_path_factory.mktemp("rfleet"),
        job_modules=[*TEST_JOB_MODULES, "tests.reliability_jobs"],
        lease_ttl_s=LEASE_TTL_S,
        reaper_interval_s=0.5,
    )
    stop = threading.Event()
    with Fleet(settings, cpu_workers=2, stop_timeout=20, extra_env=child_env()).start() as running:
        supervisor = threading.Thread(target=running.supervise, args=(stop, 0.2), daemon=True)
        supervisor.start()
        try:
            yield running
        finally:
            stop.set()
            supervisor.join(5)


@pytest.fixture(scope="module")
def rapp(rfleet):  # type: ignore[no-untyped-def]
    return rfleet.app()


@pytest.fixture
def client(rfleet):  # type: ignore[no-untyped-def]
    c = redis.Redis.from_url(rfleet.redis_url, decode_responses=True)
    yield c
    c.close()


def _pids(app) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {d: r["pid"] for d, r in tasks.live_devices(app).items()}


def _assert_fleet_healthy(app, pids_before: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    assert _pids(app) == pids_before, "a worker left the fleet or was restarted"
    results = fan_out("echo", "all", kwargs={"value": "still-up"}, app=app).get(timeout=60)
    assert {d: e["status"] for d, e in results.items()} == {d: "ok" for d in pids_before}


# -- 1. a worker killed mid-job ------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_killed_worker_job_runs_again_resumes_and_fan_out_completes(rfleet, rapp, client):
    """SIGKILL cpu0 while it trains: the launcher restarts it, the reaper gives the job back,
    the re-run resumes from the last checkpoint, and the fan-out has both devices' entries."""
    handle = fan_out(
        {
            "cpu0": ("train", {"model": "cnn", "epochs": 40, "num_workers": 0,
                               "checkpoint_every_s": 0, "hidden": 32}),
            "cpu1": ("echo", {"value": 7}),
        },
        app=rapp,
    )
    job_id = handle._headers["cpu0"].id
    resume_info = rfleet.settings.artifacts_path / job_id / "resume.json"
    wait_for(lambda: resume_info.is_file() and json.loads(resume_info.read_text())["epoch"] >= 2,
             120, "a checkpoint of epoch 2")
    first = json.loads(client.hget(LEASES_KEY, job_id))
    victim = rfleet.workers["cpu0"]
    assert first["pid"] == victim.process.pid
    restored_before = int(client.hget(REAPER_STATS, "restored") or 0)

    killed_at = time.time()
    victim.process.kill()  # SIGKILL: no warm shutdown, no ack, no goodbye

    def rerun_started():  # the lease taken again, by another process
        raw = client.hget(LEASES_KEY, job_id)
        record = json.loads(raw) if raw else None
        return record if record and record["pid"] != first["pid"] else None

    second = wait_for(rerun_started, 90, "the job to start again on a live worker")
    recovery_s = second["since"] - killed_at
    print(f"\nRECOVERY killed worker -> job running again: {recovery_s:.2f} s")
    assert recovery_s <= RECOVERY_LIMIT_S
    assert victim.restarts >= 1 and victim.alive, "supervise did not restart the worker"
    assert int(client.hget(REAPER_STATS, "restored") or 0) == restored_before + 1

    results = handle.get(timeout=150)
    assert set(results) == {"cpu0", "cpu1"}
    assert results["cpu1"]["output"]["value"] == 7
    entry = results["cpu0"]
    assert entry["status"] == "ok", entry["error"]
    assert entry["output"]["resumed_from_epoch"] >= 2
    assert entry["output"]["epochs"] == 40
    assert client.hget(LEASES_KEY, job_id) is None  # released at the end
    rfleet.wait_ready(60)


@pytest.mark.timeout(180)
def test_a_dead_workers_job_whose_message_is_gone_is_sent_again(rfleet, rapp, client, tmp_path):
    """A dropped copy of a running job acknowledged its delivery tag, so the job's message is no
    longer in Redis; then the owner dies. The reaper sends the job again from its lease record
    (same id, same fan-out), and the fan-out still completes."""
    handle = fan_out({"cpu1": ("sleepy", {"seconds": 4, "marker": str(tmp_path)})}, app=rapp)
    job_id = handle._headers["cpu1"].id
    marker = tmp_path / job_id
    wait_for(marker.is_file, 60, "the job to start")
    record = json.loads(client.hget(LEASES_KEY, job_id))
    assert record["resend"]["queue"] == "device.cpu1"
    assert client.hdel("unacked", record["delivery_tag"]) == 1  # what the dropped copy's ack did
    victim = rfleet.workers["cpu1"]
    victim.process.kill()
    entry = handle.get(timeout=120)["cpu1"]
    assert entry["status"] == "ok", entry
    assert entry["output"]["pid"] != record["pid"]  # it ran again, on the restarted worker
    events = [json.loads(line)["event"] for line in marker.read_text().splitlines()]
    assert events == ["start", "start", "end"], events
    rfleet.wait_ready(60)


@pytest.mark.timeout(120)
def test_a_redelivered_copy_of_a_job_runs_only_once(rfleet, rapp, client, tmp_path):
    """The transport gives a running job's message back (as a visibility timeout would): the
    copy waits behind the job on its device, then finds it finished and is dropped."""
    handle = fan_out({"cpu1": ("sleepy", {"seconds": 3, "marker": str(tmp_path)})}, app=rapp)
    job_id = handle._headers["cpu1"].id
    marker = tmp_path / job_id
    wait_for(marker.is_file, 60, "the job to start")
    record = json.loads(client.hget(LEASES_KEY, job_id))
    # What kombu's visibility-timeout restore does: the unacked message back onto its queue.
    with rapp.connection_for_write() as conn:
        conn.default_channel.qos.restore_by_tag(record["delivery_tag"])
    results = handle.get(timeout=60)
    assert results["cpu1"]["status"] == "ok"
    # Let the worker take the copy from the queue and drop it.
    wait_for(lambda: client.llen("device.cpu1") == 0, 30, "the copy to be consumed")
    fan_out("echo", ["cpu1"], kwargs={"value": 1}, app=rapp).get(timeout=30)
    starts = [json.loads(line) for line in marker.read_text().splitlines()]
    assert [e["event"] for e in starts] == ["start", "end"], starts


def test_a_copy_whose_lease_a_live_worker_holds_is_not_run(rfleet, rapp, client):
    """The lease is a mutex: a message for a job whose lease another live worker holds is
    acknowledged and dropped, not run at the same time."""
    live = tasks.live_devices(rapp)
    holder = live["cpu1"]
    task_id = str(uuid.uuid4())
    client.set(f"devicefleet:lease:{task_id}", json.dumps(
        {"device": "cpu1", "worker": holder["worker"], "pid": holder["pid"], "host": holder["host"],
         "task_id": task_id}), px=60_000)
    done_before = live["cpu0"]["jobs_done"]
    result = rapp.send_task(RUN_JOB, kwargs={"device": "cpu0", "job": "echo", "kwargs": {}},
                            queue="device.cpu0", task_id=task_id)
    wait_for(lambda: client.llen("device.cpu0") == 0 and not client.hlen("unacked"), 30,
             "cpu0 to take and drop the copy")
    fan_out("echo", ["cpu0"], kwargs={"value": 1}, app=rapp).get(timeout=30)
    after = tasks.live_devices(rapp)["cpu0"]
    assert after["jobs_done"] == done_before + 1  # the echo only
    assert result.state != "SUCCESS"
    client.delete(f"devicefleet:lease:{task_id}")


# -- 2. Redis restarted mid-run --------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_redis_restart_loses_no_queued_or_running_job(rfleet, rapp, tmp_path):
    pids = _pids(rapp)
    running = fan_out({"cpu0": ("sleepy", {"seconds": 4, "marker": str(tmp_path)}),
                       "cpu1": ("sleepy", {"seconds": 4, "marker": str(tmp_path)})}, app=rapp)
    queued = fan_out("echo", "all", kwargs={"value": "queued"}, app=rapp)
    wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 60, "both jobs to start")
    time.sleep(1.5)  # appendfsync everysec: let the queued messages reach the file
    assert rfleet.redis is not None
    rfleet.redis.stop()
    time.sleep(1.0)
    rfleet.redis.start()
    got = running.get(timeout=150)
    assert {d: e["status"] for d, e in got.items()} == {"cpu0": "ok", "cpu1": "ok"}
    got = queued.get(timeout=120)
    assert {d: e["output"]["value"] for d, e in got.items()} == {"cpu0": "queued", "cpu1": "queued"}
    # Workers reconnected by themselves (same processes) and take new work.
    wait_for(lambda: _pids(rapp) == pids, 30, "both workers back in the registry")
    _assert_fleet_healthy(rapp, pids)


# -- 3. out of memory ------------------------------------------------------------------------------


def test_out_of_memory_gives_an_entry_with_memory_figures_and_worker_stays(rfleet, rapp):
    pids = _pids(rapp)
    results = fan_out({"cpu0": ("oom", {}), "cpu1": ("oom", {"fallback": "cpu"})},
                      app=rapp).get(timeout=60)
    error = results["cpu0"]["error"]
    assert results["cpu0"]["status"] == "error"
    assert error["type"] == "OutOfMemory" and "out of memory" in error["message"]
    assert error["memory"]["process_rss_mib"] > 0 and error["memory"]["device"] == "cpu"
    fell_back = results["cpu1"]
    assert fell_back["status"] == "ok", fell_back["error"]
    assert fell_back["output"]["fallback_from"] == "cpu"
    assert fell_back["output"]["fallback"]["to"] == "cpu"
    bad = fan_out("oom", ["cpu0"], kwargs={"fallback": "tpu"}, app=rapp).get(timeout=60)
    assert bad["cpu0"]["error"]["type"] == "InvalidJobArguments"
    assert "fallback='tpu'" in bad["cpu0"]["error"]["message"]
    _assert_fleet_healthy(rapp, pids)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_real_cuda_out_of_memory_on_a_gpu_worker(rfleet, rapp):
    """On a GPU host: allocating far beyond the card gives an OutOfMemory entry with the CUDA
    figures, the worker stays in the fleet (recycled if memory stayed held), and the same job
    with fallback='cpu' runs on the CPU instead."""
    gpu = sorted(d for d, r in tasks.live_devices(rapp).items() if r["kind"] == "gpu")[0]
    entry = fan_out("oom", [gpu], kwargs={"allocate_gib": 4096}, app=rapp).get(timeout=120)[gpu]
    assert entry["error"]["type"] == "OutOfMemory", entry
    assert entry["error"]["memory"]["total_mib"] > 0
    assert "reserved_mib" in entry["error"]["memory"]
    rfleet.wait_ready(120)
    entry = fan_out("oom", [gpu], kwargs={"allocate_gib": 4096, "fallback": "cpu"},
                    app=rapp).get(timeout=120)[gpu]
    assert entry["status"] == "ok", entry
    assert entry["output"]["fallback"]["from"] == "cuda:0"


# -- 4. bad input ----------------------------------------------------------------------------------

BAD_SPECS = [None, 3, 2.5, [], ["train"], ("train",), ("train", {}, 1), {"kwargs": {}},
             {"name": "train", "extra": 1}, {"name": "", "kwargs": {}}, {"name": "a b"},
             {"name": "train", "kwargs": []}, {"name": "x" * 500}, "../etc/passwd", "os;rm"]


@pytest.mark.parametrize("spec", BAD_SPECS, ids=repr)
def test_malformed_job_specs_fail_at_the_producer(rfleet, rapp, spec):
    # {"kwargs": {}} reads as a {device: job} mapping: DeviceUnavailable names 'kwargs'.
    with pytest.raises((ConfigError, DeviceUnavailable)) as info:
        fan_out(spec, ["cpu0"], app=rapp)
    assert str(info.value)


def _nest(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    _nest,
    max_leaves=12,
)


@hsettings(max_examples=300, deadline=None)
@given(spec=JSON | st.tuples(st.text(max_size=20), JSON) | st.fixed_dictionaries(
    {"name": st.text(max_size=40)}, optional={"kwargs": JSON, "other": JSON}))
def test_spec_validation_fuzz_only_ever_says_config_error(spec):
    """Whatever a producer passes, JobSpec.of returns a valid spec or raises ConfigError."""
    try:
        parsed = JobSpec.of(spec)
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(parsed, JobSpec)
        json.dumps(parsed.kwargs)


def _dataset(path: Path, x: np.ndarray, y: np.ndarray) -> str:
    np.savez(path, x=x, y=y)
    return str(path)


@pytest.mark.timeout(180)
def test_bad_job_inputs_give_error_entries_and_the_worker_stays(rfleet, rapp, tmp_path):
    pids = _pids(rapp)
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip file")
    rng = np.random.default_rng(0)
    huge = _dataset(tmp_path / "huge.npz", np.full((200, 8), 3e38, dtype=np.float32),
                    rng.integers(0, 3, 200))
    cases = [
        ("nope", {}, "UnknownJob"),
        ("train", {"epochs": -1}, "InvalidJobArguments"),
        ("train", {"epochs": "many"}, "InvalidJobArguments"),
        ("train", {"lr": 1e9}, "InvalidJobArguments"),
        ("train", {"batch_size": 0}, "InvalidJobArguments"),
        ("train", {"model": ["mlp"]}, "InvalidJobArguments"),
        ("train", {"dataset": str(tmp_path / "missing.npz")}, "DatasetError"),
        ("train", {"dataset": str(corrupt)}, "DatasetError"),
        ("train", {"dataset": huge, "epochs": 3, "num_workers": 0}, "TrainingDiverged"),
    ]
    for name, kwargs, expected in cases:
        entry = fan_out(name, ["cpu0"], kwargs=kwargs, app=rapp).get(timeout=120)["cpu0"]
        assert entry["status"] == "error", (name, kwargs, entry)
        assert entry["error"]["type"] == expected, (name, kwargs, entry["error"])
        assert entry["error"]["message"]
    _assert_fleet_healthy(rapp, pids)


class _Trap:
    """Unpickling this creates a file: proof that a worker never unpickles a message."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.path),))


def _raw_publish(app, body: bytes, content_type: str, headers: dict, queue: str = "device.cpu0"):  # type: ignore[no-untyped-def]
    with app.producer_or_acquire() as producer:
        producer.publish(body, exchange=Exchange(""), routing_key=queue, content_type=content_type,
                         content_encoding="binary", headers=headers, serializer=None)


@pytest.mark.timeout(180)
def test_foreign_or_tampered_messages_in_redis_never_stop_a_worker(rfleet, rapp, client, tmp_path):
    pids = _pids(rapp)
    trap = tmp_path / "unpickled"
    task_id = str(uuid.uuid4())
    headers = {"lang": "py", "task": RUN_JOB, "id": task_id, "root_id": task_id, "argsrepr": "",
               "kwargsrepr": "", "origin": "test"}
    payload = ((), {"device": "cpu0", "job": "echo", "kwargs": {"value": _Trap(str(trap))}}, {})
    # 1. pickle: refused by content type, never unpickled.
    _raw_publish(rapp, pickle.dumps(payload), "application/x-python-serialize", headers)
    # 2. a body that is not JSON.
    _raw_publish(rapp, b"{not json", "application/json", {**headers, "id": str(uuid.uuid4())})
    # 3. JSON, but not the task protocol's shape (this one stopped a plain Celery worker).
    shapeless = str(uuid.uuid4())
    _raw_publish(rapp, b'"just a string"', "application/json", {**headers, "id": shapeless})
    # 4. no task headers at all.
    _raw_publish(rapp, b"[[], {}, {}]", "application/json", {"foo": "bar"})
    # 5. garbage pushed straight into the list, not even a kombu envelope.
    client.lpush("device.cpu0", "garbage", base64.b64encode(b"\x00\x01").decode())
    wait_for(lambda: client.llen("device.cpu0") == 0, 60, "the worker to consume the bad messages")
    _assert_fleet_healthy(rapp, pids)
    assert not trap.exists(), "a worker unpickled a message"
    # Every message acknowledged or rejected: nothing bad is held back for a redelivery.
    wait_for(lambda: client.hlen("unacked") == 0, 30, "no message left unacknowledged")
    with pytest.raises(Exception, match="malformed"):
        rapp.AsyncResult(shapeless).get(timeout=30)

    # A producer waiting on a task sent with wrong arguments gets a clear error, not a hang.
    wrong = rapp.send_task(RUN_JOB, args=[1, 2, 3, 4, 5], queue="device.cpu0")
    with pytest.raises(TypeError, match="positional argument"):
        wrong.get(timeout=60)
    unknown = rapp.send_task("devicefleet.no_such_task", queue="device.cpu0")
    with pytest.raises(Exception, match="no_such_task"):
        unknown.get(timeout=60)
    odd = rapp.send_task(RUN_JOB, kwargs={"device": "cpu0", "job": "echo", "kwargs": "x"},
                         queue="device.cpu0").get(timeout=60)
    assert odd["error"]["type"] == "InvalidJobArguments"
    wrong_device = rapp.send_task(RUN_JOB, kwargs={"device": "cpu1", "job": "echo", "kwargs": {}},
                                  queue="device.cpu0").get(timeout=60)
    assert wrong_device["error"]["type"] == "JobError"
    _assert_fleet_healthy(rapp, pids)


# -- 5. load ---------------------------------------------------------------------------------------

#: CI runs 400 jobs; `RELIABILITY_LOAD_JOBS=10000 python -m pytest tests/test_reliability.py -k load -s`
#: runs the full burst.
LOAD_JOBS = int(os.environ.get("RELIABILITY_LOAD_JOBS", "400"))
PRODUCERS = 4


@pytest.mark.timeout(max(300, LOAD_JOBS // 5))
def test_load_burst_every_job_has_exactly_one_result(rfleet, rapp, tmp_path):
    devices = sorted(_pids(rapp))
    fanouts = LOAD_JOBS // (PRODUCERS * len(devices))
    total = fanouts * PRODUCERS * len(devices)
    done_before = {d: r["jobs_done"] for d, r in tasks.live_devices(rapp).items()}
    started = time.monotonic()
    # Output to files, not pipes: a full pipe would block a producer until the loop below ends.
    logs = [(tmp_path / f"producer{p}.out", tmp_path / f"producer{p}.err") for p in range(PRODUCERS)]
    procs = []
    for p, (out_path, err_path) in enumerate(logs):
        with open(out_path, "wb") as out_file, open(err_path, "wb") as err_file:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.load_burst", rfleet.redis_url, str(p), str(fanouts)],
                stdout=out_file, stderr=err_file, env={**os.environ, **child_env()},
            ))
    status_times = []
    runner = CliRunner()
    while any(p.poll() is None for p in procs):
        t0 = time.perf_counter()
        result = runner.invoke(cli, ["status", "--json", "--redis-url", rfleet.redis_url])
        status_times.append(time.perf_counter() - t0)
        assert result.exit_code == 0, result.output
        assert set(json.loads(result.output)["workers"]) == set(devices)
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    outputs = []
    for p, (out_path, err_path) in zip(procs, logs, strict=True):
        assert p.wait() == 0, err_path.read_text(errors="replace")[-2000:]
        outputs.append(json.loads(out_path.read_text().strip().splitlines()[-1]))
    entries = [tuple(e) for o in outputs for e in o["entries"]]
    seen = {(value, device) for value, device, _, _ in entries}
    expected = {(f"p{p}-{i}", d) for p in range(PRODUCERS) for i in range(fanouts) for d in devices}
    assert len(entries) == total
    assert seen == expected, f"lost: {sorted(expected - seen)[:5]}"
    assert all(status == "ok" for _, _, status, _ in entries)
    # Executions, counted by the workers: exactly one per job, so nothing ran twice.
    done_after = wait_for(
        lambda: (lambda now: now if sum(now.values()) - sum(done_before.values()) >= total else None)(
            {d: r["jobs_done"] for d, r in tasks.live_devices(rapp).items()}), 30, "job counts")
    executed = sum(done_after.values()) - sum(done_before.values())
    print(f"\nLOAD {total} jobs from {PRODUCERS} producers in {elapsed:.1f} s "
          f"({total / elapsed:.0f} jobs/s); lost {len(expected - seen)}, executions {executed}, "
          f"status max {max(status_times):.3f} s, median "
          f"{sorted(status_times)[len(status_times) // 2]:.3f} s over {len(status_times)} calls")
    assert executed == total
    assert max(status_times) < 1.0


# -- 6. security doors -----------------------------------------------------------------------------


def test_security_doors(rfleet, rapp):
    # Embedded Redis: loopback only, with a generated password; no password, no access.
    assert rfleet.redis is not None
    assert len(rfleet.redis.password) >= 24
    anonymous = redis.Redis(host="127.0.0.1", port=rfleet.redis.port, socket_connect_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    authed = redis.Redis.from_url(rfleet.redis_url, decode_responses=True)
    assert authed.config_get("bind")["bind"] == "127.0.0.1"
    assert authed.config_get("protected-mode")["protected-mode"] == "yes"
    authed.close()
    # JSON only, both ways: a producer cannot even send pickle.
    assert list(rapp.conf.accept_content) == ["json"]
    assert list(rapp.conf.result_accept_content) == ["json"]
    # The check a worker makes on every message: pickle is refused before it is read.
    with pytest.raises(ContentDisallowed):
        kombu_loads(pickle.dumps(_Trap("/nonexistent/trap")), "application/x-python-serialize",
                    "binary", accept=rapp.conf.accept_content)
    # Jobs only from the allowlist: a module that defines a job but is not allowlisted.
    entry = fan_out("forbidden", ["cpu0"], app=rapp).get(timeout=60)["cpu0"]
    assert entry["error"]["type"] == "UnknownJob"
    # Any deploy config that names a Redis URL or server carries a password.
    root = Path(__file__).resolve().parent.parent / "deploy"
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        if path.is_file() and path.suffix in {".conf", ".env", ".service", ".toml", ".yml", ".yaml"}:
            text = path.read_text(errors="replace")
            for line in text.splitlines():
                if "redis://" in line and not line.lstrip().startswith("#"):
                    assert "@" in line, f"{path}: Redis URL without a password: {line.strip()}"
            if path.name.endswith("redis.conf") or "bind " in text and "port " in text:
                assert "requirepass" in text, f"{path}: Redis config without requirepass"
