"""The core fan-out, end to end: real redis-server, real worker processes, real chords."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import celery
import pytest
import redis
from celery.signals import before_task_publish
from safetensors.torch import load_file

import tasks
from tasks import ENTRY_KEYS, DeviceUnavailable, fan_out
from tasks.core.errors import InvalidJobArguments, UnknownJob
from tasks.core.job import task_name

from .conftest import queue_length, test_env, wait_for

pytestmark = pytest.mark.timeout(120)


def _window(entry: dict) -> tuple[float, float]:
    return (
        datetime.fromisoformat(entry["started_at"]).timestamp(),
        datetime.fromisoformat(entry["finished_at"]).timestamp(),
    )


def test_result_dict_has_one_entry_per_device_with_fixed_keys(fleet, app):
    results = fan_out("probe", "all", app=app).get(timeout=60)
    assert set(results) == set(fleet.workers)
    for device, entry in results.items():
        assert tuple(entry) == ENTRY_KEYS
        assert entry["device"] == device
        assert entry["status"] == "ok"
        assert entry["error"] is None
        assert entry["worker"].startswith(f"{device}@")
        assert entry["duration_s"] >= 0
        assert set(entry["visibility"]) == {"cuda_visible_devices", "cuda_available", "device_name"}
        json.dumps(entry)  # JSON all the way


def test_cpu_workers_see_no_gpu(fleet, app):
    results = fan_out("probe", "cpu", app=app).get(timeout=60)
    assert {"cpu0", "cpu1"} <= set(results)
    for entry in results.values():
        assert entry["visibility"]["cuda_visible_devices"] == "-1"
        assert entry["visibility"]["cuda_available"] is False
        out = entry["output"]
        assert out["env"]["CUDA_VISIBLE_DEVICES"] == "-1"
        assert out["torch"]["cuda_available"] is False
        assert out["torch"]["cuda_device_count"] == 0


def test_torch_threads_match_each_workers_cores(fleet, app):
    results = fan_out("probe", ["cpu0", "cpu1"], kwargs={"busy_s": 0.2}, app=app).get(timeout=60)
    for device in ("cpu0", "cpu1"):
        out = results[device]["output"]
        assert out["affinity"], device
        assert out["torch"]["torch_threads"] == len(out["affinity"])
        assert out["iterations"] > 0  # the busy loop ran on the device


def test_cpu_workers_own_disjoint_cores(fleet, app):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 cores: on one core the two CPU workers share it by design")
    results = fan_out("probe", ["cpu0", "cpu1"], app=app).get(timeout=60)
    a, b = (set(results[d]["output"]["affinity"]) for d in ("cpu0", "cpu1"))
    assert a and b and not (a & b), (a, b)


def test_jobs_run_at_the_same_time_on_distinct_processes(fleet, app, tmp_path):
    release = tmp_path / "release"
    handle = fan_out("hold", ["cpu0", "cpu1"], kwargs={"steps": 1, "release_file": str(release)}, app=app)
    try:
        # Each job reports its step, then waits for the release: both running at once is the event.
        wait_for(lambda: all(p.get("step") == 1 for p in handle.progress().values()), 60,
                 "both device jobs running at the same time")
    finally:
        release.touch()
    results = handle.get(timeout=60)
    (s0, e0), (s1, e1) = _window(results["cpu0"]), _window(results["cpu1"])
    assert max(s0, s1) < min(e0, e1), "the two device jobs did not overlap in time"
    live = tasks.live_devices(app)
    for device in ("cpu0", "cpu1"):
        assert results[device]["output"]["device"] == device
        # The device's own worker ran it, in one of its job processes, never in the worker itself.
        assert results[device]["output"]["pid"] in live[device].job_pids
        assert results[device]["output"]["pid"] != live[device].pid
    assert results["cpu0"]["output"]["pid"] != results["cpu1"]["output"]["pid"]


def test_one_device_failing_leaves_the_other_intact(fleet, app):
    before = tasks.live_devices(app)
    handle = fan_out({"cpu0": ("fail", {"message": "deliberate"}), "cpu1": ("echo", {"value": 42})}, app=app)
    results = handle.get(timeout=60)
    # The failed job's Celery task ends in FAILURE; the fan-out still has its error entry.
    assert handle.states() == {"cpu0": "FAILURE", "cpu1": "SUCCESS"}
    assert results["cpu0"]["status"] == "error"
    assert results["cpu0"]["error"] == {"type": "ValueError", "message": "deliberate"}
    assert results["cpu0"]["output"] is None
    assert results["cpu1"]["status"] == "ok"
    assert results["cpu1"]["output"]["value"] == 42
    assert results["cpu1"]["output"]["pid"] in before["cpu1"].job_pids  # its warm job process
    _assert_workers_still_up(app, before)


def test_missing_device_fails_fast_naming_it_and_the_live_ones(fleet, app):
    published: list[str] = []

    def count(sender=None, **_):  # type: ignore[no-untyped-def]
        published.append(str(sender))

    before_task_publish.connect(count, weak=False)
    try:
        with pytest.raises(DeviceUnavailable) as info:
            fan_out("probe", ["cpu0", "gpu7"], app=app)
        with pytest.raises(DeviceUnavailable):
            fan_out({"cpu9": "probe"}, app=app)
    finally:
        before_task_publish.disconnect(count)
    # Refused from the registry, before anything was sent: nothing waits on a worker.
    assert published == []
    message = str(info.value)
    assert "gpu7" in message and "cpu0" in message and "cpu1" in message
    assert info.value.missing == ["gpu7"]
    assert {"cpu0", "cpu1"} <= set(info.value.live)


def test_job_outside_the_allowlist_is_refused(fleet, app, tmp_path):
    """The producer checks the job against the jobs the live workers advertise and sends
    nothing; a task sent past that check (plain Celery) is refused by the worker itself."""
    before = tasks.live_devices(app)
    client = redis.Redis.from_url(fleet.redis_url)
    queued = queue_length(client, "device.cpu0")
    for name in ("forbidden", "os.system", "tests.forbidden_jobs.forbidden", "celery.backend_cleanup"):
        with pytest.raises(UnknownJob) as info:
            fan_out(name, ["cpu0"], app=app)
        message = str(info.value)
        assert repr(name) in message and "cpu0" in message, message
        assert "probe" in message and "train" in message and "nothing was sent" in message
        assert queue_length(client, "device.cpu0") == queued, name
        refused = app.send_task(task_name(name), queue="device.cpu0")
        error = refused.get(timeout=60, propagate=False)
        assert refused.state == "FAILURE" and type(error).__name__ == "UnknownJob", name
    client.close()
    _assert_workers_still_up(app, before)


def test_a_misspelt_job_gets_a_did_you_mean_at_the_producer(fleet, app):
    with pytest.raises(UnknownJob, match=r"unknown job 'trian' on cpu0, cpu1: did you mean 'train'\?"):
        fan_out("trian", ["cpu0", "cpu1"], app=app)
    with pytest.raises(UnknownJob, match=r"did you mean 'probe'\?"):
        fan_out({"cpu0": "probe", "cpu1": ("prbe", {"seconds": 0})}, app=app)


def test_bad_kwargs_are_refused_at_the_producer_before_anything_is_sent(fleet, app):
    published: list[str] = []

    def count(sender=None, **kwargs):  # type: ignore[no-untyped-def]
        published.append(sender)

    client = redis.Redis.from_url(fleet.redis_url)
    waiting = {device: queue_length(client, f"device.{device}") for device in ("cpu0", "cpu1")}
    before_task_publish.connect(count, weak=False)
    try:
        with pytest.raises(InvalidJobArguments) as typo:
            fan_out("train", ["cpu0", "cpu1"], kwargs={"epoch": 3}, app=app)
        with pytest.raises(InvalidJobArguments, match=r"^train \(trial 1\): lr=-0.5: must be > 0$"):
            tasks.sweep("train", trials=[{"lr": 0.1}, {"lr": -0.5}], kwargs={"epochs": 1}, devices="cpu", app=app)
        with pytest.raises(InvalidJobArguments, match=r"model='mpl': must be one of 'mlp', 'cnn'; did you mean 'mlp'\?"):
            fan_out({"cpu0": "probe", "cpu1": ("train", {"model": "mpl"})}, app=app)
        assert {device: queue_length(client, f"device.{device}") for device in waiting} == waiting
    finally:
        before_task_publish.disconnect(count)
        client.close()
    assert str(typo.value) == "train: unexpected argument 'epoch' (3); did you mean 'epochs'?"
    assert published == []  # refused before a message was made


def test_bad_kwargs_give_a_clear_error_entry(fleet, app, unchecked_kwargs):
    before = tasks.live_devices(app)
    results = fan_out(
        {
            "cpu0": ("train", {"epochs": "many"}),
            "cpu1": ("train", {"model": "transformer", "bogus": 1}),
        },
        app=app,
    ).get(timeout=60)
    e0, e1 = results["cpu0"]["error"], results["cpu1"]["error"]
    assert e0["type"] == "InvalidJobArguments" and "epochs='many'" in e0["message"]
    assert e1["type"] == "InvalidJobArguments"
    assert "model='transformer'" in e1["message"] and "'bogus'" in e1["message"]
    _assert_workers_still_up(app, before)


def test_missing_dataset_file_is_an_error_entry(fleet, app, tmp_path):
    missing = tmp_path / "nope.npz"
    results = fan_out("train", ["cpu0"], kwargs={"dataset": str(missing)}, app=app).get(timeout=60)
    assert results["cpu0"]["error"]["type"] == "DatasetError"
    assert str(missing) in results["cpu0"]["error"]["message"]


@pytest.mark.timeout(180)
def test_train_on_every_device_learns_digits_and_saves_a_checkpoint(fleet, app):
    results = fan_out(
        {
            "cpu0": ("train", {"model": "mlp", "epochs": 12}),
            "cpu1": ("train", {"model": "cnn", "epochs": 6, "num_workers": 1}),
        },
        app=app,
    ).get(timeout=170)
    for device, entry in results.items():
        assert entry["status"] == "ok", entry["error"]
        out = entry["output"]
        assert out["accuracy"] >= 0.9, (device, out)
        assert out["samples_per_s"] > 0
        assert 0 <= out["data_wait_fraction"] <= 1
        checkpoint = Path(out["checkpoint"])
        assert checkpoint.suffix == ".safetensors" and checkpoint.is_file()
        tensors = load_file(str(checkpoint))
        assert tensors and all(t.device.type == "cpu" for t in tensors.values())
    assert results["cpu1"]["output"]["num_workers"] == 1
    assert results["cpu1"]["output"]["model"] == "cnn"
    # A CPU device: no DataParallel, and the entry says what it did instead.
    assert results["cpu0"]["output"]["parallel"]["mode"] == "none"
    assert results["cpu0"]["output"]["parallel"]["note"].startswith("CPU: no DataParallel")


def test_get_times_out_with_the_pending_devices(fleet, app, tmp_path):
    release = tmp_path / "release"
    handle = fan_out("hold", ["cpu1"], kwargs={"steps": 1, "release_file": str(release)}, app=app)
    try:
        # The job holds until released, so the short wait below cannot see it finish.
        wait_for(lambda: handle.progress()["cpu1"].get("step") == 1, 60, "the hold job running on cpu1")
        with pytest.raises(tasks.FanOutTimeout) as info:
            handle.get(timeout=0.2)
        assert info.value.pending == ["cpu1"]
        assert not handle.ready()
    finally:
        release.touch()
    assert handle.get(timeout=30)["cpu1"]["status"] == "ok"


# -- plain Celery: the fleet is usable by a producer that knows only Celery and the broker URL ----


@pytest.fixture
def plain(fleet):
    """A bare Celery app on the fleet's Redis: no devicefleet settings, backend or signals."""
    app = celery.Celery("plain-producer", broker=fleet.redis_url, backend=fleet.redis_url, set_as_current=False)
    yield app
    # Results unsubscribe from Redis when collected: let them go while Redis still runs.
    gc.collect()
    app.close()


def test_plain_celery_send_task_runs_jobs_and_reports_failures(fleet, app, plain, unchecked_kwargs):
    sent = [plain.send_task("devicefleet.probe", kwargs={}, queue="cpu") for _ in range(10)]
    entries = [result.get(timeout=60) for result in sent]
    assert len(entries) == 10
    for result, entry in zip(sent, entries, strict=True):
        assert result.state == "SUCCESS"
        assert tuple(entry) == ENTRY_KEYS
        assert entry["status"] == "ok" and entry["error"] is None
        assert entry["device"] in {"cpu0", "cpu1"}
        assert entry["output"]["device"] == entry["device"]
    del sent

    # Bad kwargs: the task ends in FAILURE with the job's own error type.
    bad = plain.send_task("devicefleet.train", kwargs={"epochs": "many"}, queue="cpu")
    error = bad.get(timeout=60, propagate=False)
    assert bad.state == "FAILURE"
    assert type(error).__name__ == "InvalidJobArguments"
    assert "epochs='many'" in str(error)
    del bad

    # A job outside the allowlist: FAILURE with UnknownJob, not a message left unanswered.
    unknown = plain.send_task("devicefleet.forbidden", kwargs={}, queue="cpu")
    error = unknown.get(timeout=60, propagate=False)
    assert unknown.state == "FAILURE"
    assert type(error).__name__ == "UnknownJob" and "unknown job 'forbidden'" in str(error)
    del unknown

    # The same bad job in a fan-out next to a good one: an error entry for it, ok for the other.
    results = fan_out({"cpu0": ("train", {"epochs": "many"}), "cpu1": "probe"}, app=app).get(timeout=60)
    assert results["cpu0"]["status"] == "error" and results["cpu0"]["output"] is None
    assert results["cpu0"]["error"]["type"] == "InvalidJobArguments"
    assert "epochs='many'" in results["cpu0"]["error"]["message"]
    assert results["cpu1"]["status"] == "ok" and results["cpu1"]["error"] is None


def test_plain_celery_hand_built_chord_collects_every_device(fleet, plain):
    def canvas(*jobs: tuple[str, str, dict], follow_parents: bool = True) -> dict:
        header = [plain.signature(f"devicefleet.{job}", kwargs=kwargs, queue=f"device.{device}")
                  for device, job, kwargs in jobs]
        body = plain.signature("devicefleet.collect", kwargs={"devices": [d for d, _, _ in jobs]}, queue="fleet")
        return dict(celery.chord(header, app=plain)(body).get(timeout=60, follow_parents=follow_parents))

    results = canvas(("cpu0", "probe", {}), ("cpu1", "probe", {}))
    assert list(results) == ["cpu0", "cpu1"]
    for device, entry in results.items():
        assert tuple(entry) == ENTRY_KEYS
        assert entry["device"] == device and entry["status"] == "ok"
        assert entry["worker"].startswith(f"{device}@")
        assert entry["output"]["device"] == device

    # A failed part is collected as its error entry: the collect step still returns every device.
    # (Celery's get() re-raises a failed header task unless told not to follow the parents.)
    results = canvas(("cpu0", "fail", {"message": "by hand"}), ("cpu1", "echo", {"value": 7}),
                     follow_parents=False)
    assert results["cpu0"]["status"] == "error"
    assert results["cpu0"]["error"] == {"type": "ValueError", "message": "by hand"}
    assert results["cpu1"]["status"] == "ok" and results["cpu1"]["output"]["value"] == 7


def _assert_workers_still_up(app, before):
    after = tasks.live_devices(app)
    for device, record in before.items():
        assert device in after, f"{device} left the fleet"
        assert after[device].pid == record.pid, f"{device} was restarted"


@pytest.mark.timeout(120)
def test_a_script_that_exits_with_results_pending_exits_cleanly(fleet, tmp_path):
    """states()/progress() before get(), or a caught FanOutTimeout, leave AsyncResults pending
    at exit: the script still exits 0 with nothing on stderr (no AsyncResult.__del__ noise)."""
    script = tmp_path / "pending.py"
    script.write_text(
        "import tasks\n"
        "handle = tasks.fan_out('probe', ['cpu0', 'cpu1'], kwargs={'busy_s': 1, 'mode': 'sleep'})\n"
        "print(handle.states(), handle.progress())\n"
        "try:\n"
        "    handle.get(timeout=0.05)\n"
        "except tasks.FanOutTimeout as exc:\n"
        "    print('timed out:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEFLEET_")}
    env.update(test_env(), DEVICEFLEET_REDIS_URL=fleet.redis_url)
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "timed out: fan-out not finished" in done.stdout
        assert done.stderr == "", done.stderr
