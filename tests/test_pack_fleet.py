"""Packed trials on real workers: a leader takes its siblings from its sweep's queue and trains
them in one job process, each trial still its own message, lease and entry (tasks/worker/pack.py)."""

from __future__ import annotations

import pytest

import tasks
from tasks.core.errors import ConfigError
from tasks.core.records import Entry

from .conftest import wait_for

SMALL = {"model": "mlp", "epochs": 2, "num_workers": 0, "checkpoint_every_s": 3600.0}


def _trials(count: int) -> list[dict[str, object]]:
    return [{"lr": 3e-3 * (1 + i % 4), "seed": i} for i in range(count)]


@pytest.mark.timeout(300)
def test_a_packed_sweep_trains_its_trials_in_packs_with_an_entry_each(app):
    trials = _trials(8)
    handle = tasks.sweep(("train", SMALL), trials, "cpu0", pack=4, app=app)
    entries = handle.get(timeout=240)
    assert [Entry.parse(e).ok for e in entries] == [True] * 8, [e["error"] for e in entries]
    assert [e["trial"] for e in entries] == list(range(8))
    packed = [e["output"]["packed"] for e in entries]
    # They trained in packs (a leader takes up to 3 more of the trials waiting), each trial
    # with its own checkpoint.
    assert max(p["members"] for p in packed if p is not None) > 1, packed
    assert len({e["output"]["checkpoint"] for e in entries}) == 8
    alone = tasks.sweep(("train", SMALL), trials[:2], "cpu0", app=app).get(timeout=240)
    for packed_entry, lone in zip(entries[:2], alone, strict=True):
        assert abs(packed_entry["output"]["accuracy"] - lone["output"]["accuracy"]) <= 0.01


@pytest.mark.timeout(300)
def test_a_cancelled_member_leaves_its_pack_alone(app):
    trials = [{"seed": i, "epochs": 600} for i in range(4)]
    handle = tasks.sweep("packed", trials, "cpu1", pack=4, app=app)
    # Trial 1 reports progress once the pack trains; then it alone is cancelled.
    wait_for(lambda: handle.progress().get(1), 120, "trial 1 training in its pack")
    app.control.revoke(handle.task_ids[1])
    entries = handle.get(timeout=240)
    assert [e["status"] for e in entries] == ["ok", "cancelled", "ok", "ok"], [e["error"] for e in entries]
    assert entries[0]["output"]["packed"]["members"] == 4
    assert entries[1]["error"]["type"] == "JobCancelled"


@pytest.mark.timeout(300)
def test_a_freed_place_in_a_pack_takes_the_next_trial_of_the_queue(app, tmp_path):
    """A pack of 2 whose trial 1 diverges at its first epoch: trial 2 takes its place in the same
    job process (its own message, lease and entry) and ends as it does alone."""
    trials = [{"seed": 0, "epochs": 4}, {"seed": 1, "epochs": 4, "diverge": True}, {"seed": 2, "epochs": 4, "lr": 3e-2}]
    entries = tasks.sweep("packed", trials, "cpu1", pack=2, app=app).get(timeout=240)
    assert [e["status"] for e in entries] == ["ok", "error", "ok"], [e["error"] for e in entries]
    assert entries[1]["error"]["type"] == "TrainingDiverged"
    first, third = entries[0]["output"]["packed"], entries[2]["output"]["packed"]
    assert first["members"] == 2 and "refilled" not in first
    assert third == {"members": 2, "index": 1, "pid": first["pid"], "refilled": True}
    # The same trial trained alone by the packed trainer (the job's own function batches in
    # another order): its place's step count and moments started from zero.
    from tasks.core.job import DEFINED, JobContext
    from tasks.jobproc.packed import Member, train_pack

    from .fleet_jobs import PackedParams, _packed_data

    params = PackedParams(**trials[2])
    ctx = JobContext(device="cpu1", torch_device="cpu", job_id="alone", artifacts_dir=tmp_path)
    alone = train_pack(DEFINED["packed"].pack, [Member(ctx, params, _packed_data(params))], "cpu",  # type: ignore[arg-type]
                       lambda i, out, err: None)
    assert abs(entries[2]["output"]["accuracy"] - alone[0]["accuracy"]) <= 0.01
    assert entries[2]["output"]["history"][-1]["loss"] == pytest.approx(alone[0]["history"][-1]["loss"], rel=1e-4)


@pytest.mark.timeout(300)
def test_an_auto_pack_says_how_its_size_was_chosen(app):
    entries = tasks.sweep("packed", [{"seed": i} for i in range(3)], "cpu1", pack="auto", app=app).get(timeout=240)
    assert [e["status"] for e in entries] == ["ok"] * 3, [e["error"] for e in entries]
    chosen = [e["output"]["packed"]["chosen"] for e in entries if e["output"]["packed"] is not None]
    assert chosen and all(c.startswith("pack='auto': ") and "no memory budget on this slot" in c for c in chosen), chosen


@pytest.mark.timeout(300)
def test_a_pack_whose_process_dies_runs_its_unfinished_trials_again_alone(app):
    trials = [{"seed": i, "crash": i == 2} for i in range(4)]
    entries = tasks.sweep("packed", trials, "cpu1", pack=4, app=app).get(timeout=240)
    assert [e["status"] for e in entries] == ["ok", "ok", "error", "ok"], [e["error"] for e in entries]
    # The crashing trial took down only itself, alone; the others ran again unpacked and ended ok.
    assert entries[2]["error"]["type"] == "JobCrashed"
    assert [e["output"]["packed"] for e in entries if e["status"] == "ok"] == [None, None, None]


def test_pack_on_a_job_that_does_not_opt_in_is_refused_before_anything_is_sent(app):
    with pytest.raises(ConfigError, match=r"pack=2: job 'counted' does not pack on cpu0"):
        tasks.sweep("counted", [{"marker": "unused"}], devices="cpu0", pack=2, app=app)


@pytest.mark.timeout(300)
def test_a_packed_study_trains_its_trials_in_packs_and_tells_each_to_optuna(app):
    pytest.importorskip("optuna")
    from tasks.producer.optimize import start_study
    from tasks.producer.trials import entry_of

    handle = start_study("packed", {"lr": {"low": 1e-3, "high": 1e-1, "log": True}}, 4, "accuracy",
                         devices="cpu1", kwargs={"epochs": 2}, pack=4, app=app)
    assert handle.packing.reason == "packed 4"
    study = handle.get(timeout=240)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
    metas = handle.queue.metas(list(handle.jobs().values()))
    outputs = [entry_of(metas[task_id])["output"] for task_id in handle.jobs().values()]
    assert [t.value for t in study.trials] == [out["accuracy"] for out in outputs]
    # Optuna's trials were sent at once (4 per slot) and trained in packs, each its own entry.
    assert max(out["packed"]["members"] for out in outputs if out["packed"] is not None) > 1, outputs
    with pytest.raises(ConfigError, match=r"pack=2: job 'counted' does not pack on cpu0"):
        start_study("counted", {"score": [0.5]}, 2, "score", devices="cpu0", kwargs={"marker": "unused"},
                    pack=2, app=app)
