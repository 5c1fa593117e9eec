"""Slots: one device runs several jobs at once, each in its own job process, on its share of the
cores, within a memory budget the worker enforces (a real fleet: one CPU worker with
``slots = 2``, and each visible GPU with two slots too)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psutil
import pytest

import tasks
from tasks import fan_out
from tasks.core.registry import connect, read_worker
from tasks.ops.exporter import FleetCollector, fleet_snapshot
from tasks.ops.fleet import Fleet

from .conftest import make_settings, test_env, wait_for, worker_configs

#: Each slot's budget in the test fleet: a job process with torch loaded holds about 0.2 GiB
#: (PSS), so a job that keeps 1500 MiB more is past it and one that keeps 10 MiB is not.
BUDGET_GIB = 1.0
CANCEL_GRACE_S = 2.0


@pytest.fixture(scope="module")
def sfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    state = tmp_path_factory.mktemp("slots")
    configs = worker_configs(state / "worker_configs", slots=2, memory_gib=BUDGET_GIB,
                             cancel_grace_s=CANCEL_GRACE_S)
    settings = make_settings(state, worker_configs_dir=configs)
    with Fleet(settings, cpu_workers=1, stop_timeout=20, extra_env=test_env()).start() as running:
        yield running


@pytest.fixture(scope="module")
def sapp(sfleet: Fleet):  # type: ignore[no-untyped-def]
    return sfleet.app()


def _running(handle: tasks.FanOut, key: str) -> bool:
    return handle.states()[key] in ("STARTED", "PROGRESS")


@pytest.mark.timeout(90)
def test_a_device_with_two_slots_runs_two_jobs_at_once_on_its_own_cores(sfleet, sapp, tmp_path):
    record = tasks.live_devices(sapp)["cpu0"]
    assert record.slot_count == 2 and [slot.index for slot in record.slots] == [0, 1]
    assert all(slot.budget_bytes == int(BUDGET_GIB * 2**30) for slot in record.slots)
    # Each job waits until both have started: a device that ran one at a time would time out.
    handle = fan_out("meet", "cpu0", kwargs={"folder": str(tmp_path / "pair"), "timeout_s": 30},
                     per_slot=True, app=sapp)
    results = handle.get(timeout=60)
    assert list(results) == ["cpu0/0", "cpu0/1"]
    entries = list(results.values())
    assert all(e["status"] == "ok" and e["device"] == "cpu0" for e in entries), entries
    assert sorted(e["slot"] for e in entries) == [0, 1]
    assert sorted(e["output"]["slot"] for e in entries) == [0, 1]
    assert entries[0]["output"]["pid"] != entries[1]["output"]["pid"]
    cores = {e["output"]["slot"]: e["output"]["cores"] for e in entries}
    assert cores == {slot.index: sorted(slot.cores) for slot in record.slots}
    # Two cores or more: each slot its own; one core: shared.
    own_cores = len(psutil.Process().cpu_affinity() or []) >= 2
    assert set(cores[0]).isdisjoint(cores[1]) is own_cores


@pytest.mark.timeout(90)
def test_a_job_past_its_memory_budget_ends_as_out_of_memory_while_its_neighbour_finishes(sfleet, sapp, tmp_path):
    release = tmp_path / "release"
    neighbour = fan_out("hog", "cpu0", kwargs={"mib": 10, "release_file": str(release)}, app=sapp)
    wait_for(lambda: _running(neighbour, "cpu0"), 30, "the neighbour to start")
    hog = fan_out("hog", "cpu0", kwargs={"mib": 1500, "release_file": str(release)}, app=sapp)
    entry = hog.get(timeout=60)["cpu0"]
    assert entry["status"] == "error" and entry["error"]["type"] == "OutOfMemory", entry
    memory = entry["error"]["memory"]
    assert memory["measured"] == "resident" and memory["budget_mib"] == BUDGET_GIB * 1024
    assert memory["used_mib"] > memory["budget_mib"]
    assert f"budget of {BUDGET_GIB * 1024:.0f} MiB" in entry["error"]["message"]
    # The neighbour's process was never touched: it still runs, and finishes once released.
    assert _running(neighbour, "cpu0")
    release.touch()
    done = neighbour.get(timeout=60)["cpu0"]
    assert done["status"] == "ok" and done["output"]["held_mib"] == 10
    assert done["slot"] != entry["slot"]


@pytest.mark.timeout(120)
def test_cancel_and_time_limit_hold_per_slot_and_status_shows_each_slot(sfleet, sapp, tmp_path):
    release = tmp_path / "never"
    held = fan_out("hold", "cpu0", kwargs={"steps": 2, "release_file": str(release)}, app=sapp)
    wait_for(lambda: _running(held, "cpu0"), 30, "the held job to start")
    # The registry, the status dict and Prometheus show the busy slot and its sampled memory.
    client = connect(sfleet.redis_url)
    job_id = held.task_ids["cpu0"]
    try:
        # The registry is written within 50 ms of a change (a heartbeat folds close changes), and
        # the memory of a running job about once a second: wait for this job's.
        record = wait_for(lambda: (r := read_worker(client, "cpu0")) is not None
                          and any(s.busy and s.busy.job_id == job_id and s.memory_bytes for s in r.slots)
                          and not any(s.busy and s.busy.job_id != job_id for s in r.slots) and r, 30,
                          "the busy slot's memory in the registry")
        busy = [slot for slot in record.slots if slot.busy is not None]
        assert len(busy) == 1 and busy[0].busy.job == "hold" and busy[0].memory_bytes > 0
        # Its reports name the slot (what Flower shows of it), as does the slot's record.
        assert held.progress()["cpu0"]["slot"] == busy[0].index
        assert busy[0].progress is not None and busy[0].progress["step"] == 2
        snap = fleet_snapshot(client)["devices"]["cpu0"]
        assert [bool(s["busy"]) for s in snap["slots"]].count(True) == 1 and snap["memory_kind"] == "resident"
    finally:
        client.close()
    collector = FleetCollector(sfleet.redis_url)
    try:
        metrics = {m.name: m for m in collector.collect()}
    finally:
        collector.close()
    assert sum(s.value for s in metrics["devicefleet_slot_busy"].samples) == 1
    assert {s.labels["slot"] for s in metrics["devicefleet_slot_memory_budget_bytes"].samples} == {"0", "1"}
    assert next(s.value for s in metrics["devicefleet_slots"].samples if s.labels["device"] == "cpu0") == 2

    # The other slot's job runs past its time limit and ends; the held one goes on.
    limited = fan_out("hold", "cpu0", kwargs={"steps": 1, "release_file": str(release)},
                      options={"time_limit_s": 1}, app=sapp)
    entry = limited.get(timeout=60)["cpu0"]
    assert entry["error"]["type"] == "JobTimeout", entry
    assert _running(held, "cpu0")
    held.cancel()
    entry = held.get(timeout=60)["cpu0"]
    assert entry["status"] == "cancelled", entry
    # Both slots take work again.
    again = fan_out("meet", "cpu0", kwargs={"folder": str(tmp_path / "again"), "timeout_s": 30},
                    per_slot=True, app=sapp).get(timeout=60)
    assert all(e["status"] == "ok" for e in again.values()), again


@pytest.mark.timeout(120)
def test_a_sweep_fills_every_slot(sfleet, sapp, tmp_path):
    # Trials 2k and 2k+1 meet in their own folder: each pair returns only if it ran at once.
    trials = [{"folder": str(tmp_path / f"pair{i // 2}"), "timeout_s": 30} for i in range(6)]
    entries = tasks.sweep("meet", trials, devices="cpu0", app=sapp).get(timeout=120)
    assert [e["status"] for e in entries] == ["ok"] * 6, [e.get("error") for e in entries]
    assert {e["slot"] for e in entries} == {0, 1}
    for pair in range(3):
        started = [json.loads(p.read_text()) for p in (tmp_path / f"pair{pair}").glob("*.started")]
        assert sorted(s["slot"] for s in started) == [0, 1]


@pytest.mark.timeout(60)
def test_optuna_runs_one_trial_per_slot_by_default(sfleet, sapp):
    pytest.importorskip("optuna")
    seen: list[int] = []

    def on_device(progress) -> None:  # type: ignore[no-untyped-def]
        seen.append(sum(1 for device in progress.running.values() if device is not None))

    study = tasks.optimize("probe", {"score": {"low": 0.0, "high": 1.0}}, 4, "score", devices="cpu0",
                           kwargs={"busy_s": 1.0, "mode": "sleep"}, on_update=on_device, app=sapp)
    assert len(study.trials) == 4
    assert max(seen) == 2  # running on both slots of cpu0 at once, never more


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_gpu_job_past_its_slot_budget_ends_as_out_of_memory_while_its_neighbour_finishes(sfleet, sapp, tmp_path):
    gpus = sorted(d for d, r in tasks.live_devices(sapp).items() if r.kind == "gpu")
    assert gpus, "a GPU host runs a GPU worker"
    gpu = gpus[0]
    release = tmp_path / "release"
    neighbour = fan_out("gpu_hog", gpu, kwargs={"mib": 64, "release_file": str(release)}, app=sapp)
    wait_for(lambda: _running(neighbour, gpu), 120, "the GPU neighbour to start")
    entry = fan_out("gpu_hog", gpu, kwargs={"mib": 4096, "release_file": str(release)},
                    app=sapp).get(timeout=120)[gpu]
    assert entry["error"]["type"] == "OutOfMemory", entry
    assert _running(neighbour, gpu)
    release.touch()
    assert neighbour.get(timeout=120)[gpu]["status"] == "ok"
