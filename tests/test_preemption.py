"""Preemption on the session fleet (tasks.worker.preemption): a preempted job keeps its place
among its level, one waiting message preempts one job however many workers see it, a sweep's
own queue is watched too, and the issue's first goal (an urgent fan-out takes both devices of a
checkpointing batch sweep within the grace, and the sweep then finishes, each preempted trial
resumed from its checkpoint, no trial running twice at once)."""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

import pytest

from tasks import fan_out, live_devices, sweep
from tasks.core.defaults import PREEMPT_GRACE_S

from .conftest import wait_for

#: Trials of the sweep the urgent fan-out preempts (PREEMPT_LONG_SWEEP=200 for the issue's size).
SWEEP_TRIALS = int(os.environ.get("PREEMPT_LONG_SWEEP") or 12)
#: A trial: 20 steps of 0.1 s (2 s), one checkpoint per step.
TRIAL_STEPS, STEP_S = 20, 0.1


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _runs(events: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Each label's events in order: ``[("start", step), ("preempted", step), ...]``."""
    runs: dict[str, list[tuple[str, int]]] = {}
    for line in events:
        parts = line.split()
        if len(parts) >= 3:  # a resumable job's event (a stamp's line is its label alone)
            runs.setdefault(parts[0], []).append((parts[1], int(parts[-1])))
    return runs


@pytest.mark.timeout(120)
def test_a_job_preempted_for_a_sweeps_own_queue_keeps_its_place_before_later_work_of_its_level(
        fleet, app, tmp_path):
    release, events = tmp_path / "release", tmp_path / "events"
    first = fan_out("resumable", ["cpu0"], kwargs={"path": str(events), "label": "a", "steps": 6, "hold_at": 3,
                                                   "release_file": str(release)}, priority="batch", app=app)
    try:
        wait_for(lambda: first.progress()["cpu0"].get("step") == 3, 60, "batch job a running on cpu0")
        later = [fan_out("stamp", ["cpu0"], kwargs={"path": str(events), "label": f"b{i}"}, priority="batch",
                         app=app) for i in range(2)]
        # One device of two: the urgent sweep's own queue, which cpu0 is asked to consume.
        urgent = sweep("stamp", [{"label": "u"}], devices="cpu0", kwargs={"path": str(events)}, priority="urgent",
                       app=app)
        assert urgent.queue.list == f"sweep.{urgent.id}:urgent"
        assert [entry["status"] for entry in urgent.get(timeout=60)] == ["ok"]
    finally:
        release.touch()
    entry = first.get(timeout=60)["cpu0"]
    assert (entry["status"], entry["preemptions"], entry["output"]) == ("ok", 1, {"step": 6, "attempt": 2})
    assert all(handle.get(timeout=60)["cpu0"]["status"] == "ok" for handle in later)
    # a went back to the front of cpu0's batch list: it ran again before b0 and b1, sent after it.
    assert _lines(events) == ["a start 1 0", "a preempted 3", "u", "a start 2 3", "a done 6", "b0", "b1"]


@pytest.mark.timeout(120)
def test_one_urgent_message_on_a_shared_queue_preempts_one_job_not_one_per_device(fleet, app, tmp_path):
    release, events = tmp_path / "release", tmp_path / "events"
    batch = fan_out("resumable", ["cpu0", "cpu1"], kwargs={"path": str(events), "label": "held", "steps": 6,
                                                          "hold_at": 3, "release_file": str(release)},
                    priority="batch", app=app)
    try:
        wait_for(lambda: all(p.get("step") == 3 for p in batch.progress().values()), 60,
                 "the batch job running on cpu0 and cpu1")
        # Both devices' trials: the queue every CPU worker consumes (`fleet` or `cpu`), both busy.
        urgent = sweep("stamp", [{"label": "u"}], devices="cpu", kwargs={"path": str(events)}, priority="urgent",
                       app=app)
        assert urgent.queue.list in ("fleet:urgent", "cpu:urgent")
        assert [entry["status"] for entry in urgent.get(timeout=60)] == ["ok"]
    finally:
        release.touch()
    entries = batch.get(timeout=60)
    assert [entry["status"] for entry in entries.values()] == ["ok", "ok"]
    assert sorted(entry["preemptions"] for entry in entries.values()) == [0, 1]
    assert _lines(events).count("held preempted 3") == 1


@pytest.mark.timeout(60 + SWEEP_TRIALS * 3)
def test_an_urgent_fan_out_takes_both_devices_of_a_batch_sweep_which_then_resumes_every_trial(
        fleet, app, tmp_path):
    release, events = tmp_path / "release", tmp_path / "events"
    # The first two trials (one per device) hold halfway until the urgent work is done: they are
    # running when it comes, whatever the load, and must be preempted for it to start.
    trials = sweep("resumable", [{"label": f"t{i}", "hold_at": TRIAL_STEPS // 2 if i < 2 else TRIAL_STEPS}
                                 for i in range(SWEEP_TRIALS)], devices="cpu",
                   kwargs={"path": str(events), "steps": TRIAL_STEPS, "step_s": STEP_S,
                           "release_file": str(release)}, priority="batch", app=app)
    try:
        wait_for(lambda: {"t0 start 1 0", "t1 start 1 0"} <= set(_lines(events)), 60,
                 "the sweep's first trials running on both devices")
        sent = time.time()
        urgent = fan_out("stamp", ["cpu0", "cpu1"], kwargs={"path": str(events), "label": "urgent"},
                         priority="urgent", app=app)
        urgent_entries = urgent.get(timeout=60)
    finally:
        release.touch()
    waits = {device: datetime.fromisoformat(entry["started_at"]).timestamp() - sent
             for device, entry in urgent_entries.items()}
    entries = trials.get(timeout=30 + SWEEP_TRIALS * 2)
    runs = _runs(_lines(events))
    preempted = [entry for entry in entries if entry["preemptions"]]
    print(f"\npreemption sweep: {SWEEP_TRIALS} trials of {TRIAL_STEPS * STEP_S:g} s on cpu0+cpu1; urgent started "
          + ", ".join(f"{device} {wait:.2f} s" for device, wait in sorted(waits.items()))
          + f" after it was sent (bound: grace {PREEMPT_GRACE_S:g} s + 1); {len(preempted)} trials preempted "
          f"({sum(entry['preemptions'] for entry in entries)} times), all resumed from their checkpoints")
    assert all(entry["status"] == "ok" for entry in urgent_entries.values())
    assert all(wait <= PREEMPT_GRACE_S + 1 for wait in waits.values()), waits
    assert [entry["status"] for entry in entries] == ["ok"] * SWEEP_TRIALS
    assert all(entry["output"] == {"step": TRIAL_STEPS, "attempt": entry["preemptions"] + 1} for entry in entries)
    assert entries[0]["preemptions"] >= 1 and entries[1]["preemptions"] >= 1
    for label, run in runs.items():
        # One run at a time: each start is followed by its end before the next start; each run
        # after the first starts at the step the last one checkpointed (never from nothing).
        kinds = [kind for kind, _ in run]
        assert kinds == ["start", "preempted"] * (len(run) // 2 - 1) + ["start", "done"], (label, run)
        assert all(run[i + 1] == ("start", run[i][1]) for i in range(1, len(run) - 1, 2)), (label, run)
    # The preempted trials went back to the front of the batch list: they ran again before t2.
    starts = [line for line in _lines(events) if " start " in line]
    assert starts.index("t2 start 1 0") > max(starts.index("t0 start 2 10"), starts.index("t1 start 2 10"))


@pytest.mark.timeout(150)
def test_a_batch_gang_makes_way_as_a_whole_for_urgent_work_on_one_of_its_devices(fleet, app, tmp_path):
    release, runs, events = tmp_path / "release", tmp_path / "runs", tmp_path / "events"
    runs.mkdir()
    gang = fan_out("ranked", "cpu0,cpu1", kwargs={"steps": 2, "marker": str(runs), "release_file": str(release)},
                   distributed=True, priority="batch", app=app)
    try:
        # Both ranks wait after their first all_reduce until released: neither can end first.
        wait_for(lambda: all(p.get("waiting") for p in gang.progress().values()) and len(gang.progress()) == 2,
                 90, "both ranks of the batch gang running")
        urgent = fan_out("stamp", ["cpu0"], kwargs={"path": str(events), "label": "urgent"}, priority="urgent",
                         app=app)
        assert urgent.get(timeout=60)["cpu0"]["status"] == "ok"
    finally:
        release.touch()
    results = gang.get(timeout=90)
    # cpu1's rank, not asked by its own worker, stopped with it (no hang in a collective, no
    # failure): each went back to its queue once and the gang ran again as one.
    assert {device: (entry["status"], entry["preemptions"]) for device, entry in results.items()} == {
        "cpu0": ("ok", 1), "cpu1": ("ok", 1)}, results
    assert {entry["output"]["sum"] for entry in results.values()} == {3.0}
    assert {device: len((runs / device).read_text().splitlines()) for device in ("cpu0", "cpu1")} == {
        "cpu0": 2, "cpu1": 2}


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_batch_train_on_a_gpu_makes_way_with_its_memory_freed_and_resumes_from_its_checkpoint(fleet, app):
    gpu = sorted(d for d, r in live_devices(app).items() if r.kind == "gpu")[0]
    batch = fan_out("train", [gpu], kwargs={"epochs": 150, "batch_size": 16, "hidden": 4096}, priority="batch",
                    app=app)
    wait_for(lambda: (batch.progress()[gpu].get("epoch") or 0) >= 3, 120, f"the batch train running on {gpu}")
    urgent = fan_out("gpu_memory", [gpu], priority="urgent", app=app).get(timeout=120)[gpu]
    entry = batch.get(timeout=240)[gpu]
    print(f"\ngpu preemption on {gpu}: the urgent job found {urgent['output']['used_mib']} MiB used on the device "
          f"(allocated {urgent['output']['allocated']}, reserved {urgent['output']['reserved']} bytes in the job "
          f"process the train ran in); the train resumed from epoch {entry['output']['resumed_from_epoch']}")
    assert urgent["status"] == "ok", urgent
    # The preempted train's tensors were freed before the urgent job started in the same process.
    assert (urgent["output"]["allocated"], urgent["output"]["reserved"]) == (0, 0)
    assert (entry["status"], entry["preemptions"]) == ("ok", 1), entry
    assert entry["output"]["resumed_from_epoch"] >= 3
