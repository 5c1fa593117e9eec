"""The core fan-out, end to end: real redis-server, real worker processes, real chords."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

import pytest
from safetensors.torch import load_file

import tasks
from tasks import ENTRY_KEYS, DeviceUnavailable, fan_out

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


def test_cpu_workers_own_disjoint_cores_and_threads(fleet, app):
    results = fan_out("probe", ["cpu0", "cpu1"], app=app).get(timeout=60)
    a, b = (set(results[d]["output"]["affinity"]) for d in ("cpu0", "cpu1"))
    if len(os.sched_getaffinity(0)) >= 2:
        assert a and b and not (a & b)
    for device in ("cpu0", "cpu1"):
        out = results[device]["output"]
        assert out["torch"]["torch_threads"] == len(out["affinity"])


def test_jobs_run_at_the_same_time_on_distinct_processes(fleet, app):
    results = fan_out("probe", ["cpu0", "cpu1"], kwargs={"busy_s": 1.5}, app=app).get(timeout=60)
    (s0, e0), (s1, e1) = _window(results["cpu0"]), _window(results["cpu1"])
    assert max(s0, s1) < min(e0, e1), "the two device jobs did not overlap in time"
    assert results["cpu0"]["output"]["pid"] != results["cpu1"]["output"]["pid"]
    assert results["cpu0"]["output"]["iterations"] > 0


def test_one_device_failing_leaves_the_other_intact(fleet, app):
    before = tasks.live_devices(app)
    results = fan_out(
        {"cpu0": ("fail", {"message": "deliberate"}), "cpu1": ("echo", {"value": 42})}, app=app
    ).get(timeout=60)
    assert results["cpu0"]["status"] == "error"
    assert results["cpu0"]["error"] == {"type": "ValueError", "message": "deliberate"}
    assert results["cpu0"]["output"] is None
    assert results["cpu1"]["status"] == "ok"
    assert results["cpu1"]["output"]["value"] == 42
    _assert_workers_still_up(app, before)


def test_missing_device_fails_fast_naming_it_and_the_live_ones(fleet, app):
    started = time.monotonic()
    with pytest.raises(DeviceUnavailable) as info:
        fan_out("probe", ["cpu0", "gpu7"], app=app)
    assert time.monotonic() - started < 2.0
    message = str(info.value)
    assert "gpu7" in message and "cpu0" in message and "cpu1" in message
    assert info.value.missing == ["gpu7"]
    with pytest.raises(DeviceUnavailable):
        fan_out({"cpu9": "probe"}, app=app)


def test_job_outside_the_allowlist_is_refused(fleet, app, tmp_path):
    before = tasks.live_devices(app)
    for name in ("forbidden", "os.system", "tests.forbidden_jobs.forbidden", "celery.backend_cleanup"):
        results = fan_out(name, ["cpu0"], app=app).get(timeout=60)
        entry = results["cpu0"]
        assert entry["status"] == "error", name
        assert entry["error"]["type"] == "UnknownJob"
        assert repr(name) in entry["error"]["message"]
        assert "probe" in entry["error"]["message"] and "train" in entry["error"]["message"]
    _assert_workers_still_up(app, before)


def test_bad_kwargs_give_a_clear_error_entry(fleet, app):
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


def test_get_times_out_with_the_pending_devices(fleet, app):
    handle = fan_out("probe", ["cpu1"], kwargs={"busy_s": 2, "mode": "sleep"}, app=app)
    with pytest.raises(tasks.FanOutTimeout) as info:
        handle.get(timeout=0.2)
    assert info.value.pending == ["cpu1"]
    assert handle.get(timeout=30)["cpu1"]["status"] == "ok"


def _assert_workers_still_up(app, before):
    after = tasks.live_devices(app)
    for device, record in before.items():
        assert device in after, f"{device} left the fleet"
        assert after[device]["pid"] == record["pid"], f"{device} was restarted"
