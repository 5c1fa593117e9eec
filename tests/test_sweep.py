"""Sweeps and Optuna studies against the real session fleet (cpu0 + cpu1), and their CLI.

Trials run the test job ``counted`` (tests/fleet_jobs.py), which appends one line per run to
``<marker>/<task id>``: the tests count runs from those files, not from what the fleet says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

import tasks
from tasks.core import keys
from tasks.core.registry import connect
from tasks.producer.optimize import journal_storage, parse_space
from tasks.producer.trials import trial_task_id

from .conftest import ROOT, test_env, wait_for

CLI = [sys.executable, "-m", "tasks"]


def _runs(marker: Path) -> dict[str, int]:
    """``{task id: how many times it ran}``."""
    return {path.name: len(path.read_text().splitlines()) for path in marker.iterdir()}


def _trials(marker: Path, n: int, **fields: object) -> list[dict[str, object]]:
    return [{"marker": str(marker), "score": float(i), **fields} for i in range(n)]


@pytest.mark.timeout(90)
def test_twenty_trials_over_two_devices_run_once_each_on_both(fleet, app, tmp_path):
    # Mixed lengths, so a device that is free takes the next trial while the other is busy.
    trials = [{"marker": str(tmp_path), "score": float(i), "seconds": 0.02 * (i % 5)} for i in range(20)]
    handle = tasks.sweep("counted", trials, devices="cpu0,cpu1", app=app)
    entries = handle.get(timeout=60)

    assert [e["trial"] for e in entries] == list(range(20))
    assert all(set(tasks.ENTRY_KEYS) <= set(e) for e in entries)
    assert [e["status"] for e in entries] == ["ok"] * 20
    assert [e["output"]["score"] for e in entries] == [float(i) for i in range(20)]
    assert [e["kwargs"] for e in entries] == trials
    runs = _runs(tmp_path)
    assert sorted(runs) == sorted(handle.task_ids) and set(runs.values()) == {1}
    used = {e["device"] for e in entries}
    assert used == {"cpu0", "cpu1"}
    summary = handle.summary()
    assert (summary.done, summary.running, summary.queued, summary.failed) == (20, 0, 0, 0)
    assert sum(d["done"] for d in summary.devices.values()) == 20


@pytest.mark.timeout(60)
def test_a_sweep_on_some_devices_has_its_own_queue_only_they_consume(fleet, app, tmp_path):
    handle = tasks.sweep("counted", _trials(tmp_path, 6, seconds=0.05), devices="cpu1", app=app)
    assert handle.queue.queue == f"sweep.{handle.id}" and handle.queue.own
    entries = handle.get(timeout=30)
    assert {e["device"] for e in entries} == {"cpu1"} and [e["status"] for e in entries] == ["ok"] * 6

    live = tasks.live_devices(app)
    nodes = [live["cpu0"].worker, live["cpu1"].worker]

    def consumed() -> dict[str, list[str]]:
        # Both workers' answers, however late they come on a loaded machine (the broadcast
        # returns once both answered; a fixed short timeout would leave one out).
        replies = app.control.inspect(destination=nodes, limit=len(nodes), timeout=30).active_queues() or {}
        return {node.split("@")[0]: [q["name"] for q in queues] for node, queues in replies.items()}

    # Done: the worker let the sweep's queue go; the other device never consumed it.
    wait_for(lambda: set(replies := consumed()) == {"cpu0", "cpu1"}
             and all(handle.queue.queue not in names for names in replies.values()), 30, "the sweep's queue let go")


@pytest.mark.timeout(60)
def test_a_failing_trial_is_a_failed_entry_not_a_failed_sweep(fleet, app, tmp_path):
    trials = _trials(tmp_path, 4)
    trials[2]["fail"] = True
    entries = tasks.sweep("counted", trials, app=app).get(timeout=30)
    assert [e["status"] for e in entries] == ["ok", "ok", "error", "ok"]
    assert entries[2]["error"]["type"] == "ValueError"
    assert "failed on purpose" in entries[2]["error"]["message"]


@pytest.mark.timeout(90)
def test_cancel_stops_running_trials_and_never_starts_queued_ones(fleet, app, tmp_path):
    handle = tasks.sweep("counted", _trials(tmp_path, 6, seconds=30.0, steps=300), app=app)
    wait_for(lambda: handle.summary().running == 2, 30, "both devices running a trial")
    handle.cancel()
    entries = handle.get(timeout=30)

    assert [e["status"] for e in entries] == ["cancelled"] * 6
    ran = [e for e in entries if e["device"] is not None]
    assert sorted(e["device"] for e in ran) == ["cpu0", "cpu1"]
    assert all(e["error"]["type"] == "JobCancelled" for e in ran)
    assert len(_runs(tmp_path)) == 2  # the four queued trials never started
    assert [str(s) for s in handle.states()].count("REVOKED") == 6
    # The workers stay up and take the next job at once.
    after = tasks.fan_out("noop", app=app).get(timeout=30)
    assert {e["status"] for e in after.values()} == {"ok"}


@pytest.mark.timeout(60)
def test_fan_out_cancel_stops_each_device_at_its_next_progress_call(fleet, app, tmp_path):
    handle = tasks.fan_out("counted", kwargs={"marker": str(tmp_path), "seconds": 30.0, "steps": 300}, app=app)
    wait_for(lambda: set(handle.states().values()) == {"PROGRESS"}, 30, "both devices reporting")
    handle.cancel()
    results = handle.get(timeout=30)
    assert {d: e["status"] for d, e in results.items()} == {"cpu0": "cancelled", "cpu1": "cancelled"}
    assert set(handle.states().values()) == {"REVOKED"}


@pytest.mark.timeout(120)
def test_a_killed_producer_resumes_with_every_trial_exactly_once(fleet, app, tmp_path):
    marker = tmp_path / "runs"
    marker.mkdir()
    trials = _trials(marker, 12, seconds=0.4)
    script = tmp_path / "producer.py"
    script.write_text(textwrap.dedent(f"""
        import tasks
        from tasks.core.settings import Settings
        app = tasks.create_app(Settings.load(redis_url={fleet.redis_url!r}))
        handle = tasks.sweep("counted", {trials!r}, name="resume-me", max_concurrent=4, app=app)
        print("sent", flush=True)
        handle.get(timeout=120)
    """))
    env = {**os.environ, **test_env()}
    producer = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL)
    try:
        # Killed mid-sweep: some trials finished, some running, most never sent.
        wait_for(lambda: len(_runs(marker)) >= 5, 60, "five trials started", proc=producer)
    finally:
        producer.send_signal(signal.SIGKILL)
        producer.wait(timeout=30)
    sent_before = connect(fleet.redis_url).scard(keys.sweep_sent("resume-me"))
    assert 0 < sent_before < 12

    entries = tasks.sweep("counted", trials, name="resume-me", max_concurrent=4, app=app).get(timeout=90)
    assert [e["status"] for e in entries] == ["ok"] * 12
    assert [e["output"]["score"] for e in entries] == [float(i) for i in range(12)]
    runs = _runs(marker)
    assert sorted(runs) == sorted(trial_task_id("resume-me", i) for i in range(12))
    assert set(runs.values()) == {1}, runs


@pytest.mark.timeout(60)
def test_bad_input_fails_at_the_producer_naming_it(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    with pytest.raises(tasks.ConfigError, match=r"trial 1 is 'lr=0.1', not a dict"):
        tasks.sweep("counted", [{"marker": "x"}, "lr=0.1"], name="bad-input", app=app)
    assert client.get(keys.sweep("bad-input")) is None  # nothing was sent
    with pytest.raises(tasks.UnknownJob, match="did you mean 'counted'"):
        tasks.sweep("countd", [{}], app=app)
    with pytest.raises(tasks.ConfigError, match="grid axis 'lr'"):
        tasks.grid({"lr": 0.1})
    assert tasks.grid({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]

    tasks.sweep("counted", _trials(tmp_path, 2), name="taken", app=app).get(timeout=30)
    with pytest.raises(tasks.SweepConflict, match="'taken' exists with 2 trials"):
        tasks.sweep("counted", _trials(tmp_path, 3), name="taken", app=app)

    with pytest.raises(tasks.ConfigError, match=r"space\['lr'\]"):
        tasks.optimize("counted", {"lr": {"low": 1.0, "high": 0.1}}, 2, "score", app=app)
    with pytest.raises(tasks.ConfigError, match=r"objective 'accuracy' is not a number .* returned device, pid, score"):
        tasks.optimize("counted", {"score": [0.5, 1.0]}, 4, "accuracy", kwargs={"marker": str(tmp_path)}, app=app)
    with pytest.raises(tasks.InvalidJobArguments,  # the fixed kwargs: refused before the study starts
                       match=r"^counted: unexpected argument 'stepz' \(1\); did you mean 'steps'\?$"):
        tasks.optimize("counted", {"score": [0.5]}, 1, "score", kwargs={"stepz": 1, "marker": str(tmp_path)}, app=app)
    with pytest.raises(tasks.ConfigError, match="refused trial 0's parameters .*'lr'"):
        tasks.optimize("counted", {"lr": [0.1]}, 1, "score", kwargs={"marker": str(tmp_path)},
                       max_concurrent=1, app=app)


def test_space_forms_and_missing_optuna():
    space = parse_space({"lr": {"low": 1e-4, "high": 0.1, "log": True}, "layers": {"low": 1, "high": 4},
                         "model": ["mlp", "cnn"],
                         "p": json.loads(optuna.distributions.distribution_to_json(
                             optuna.distributions.FloatDistribution(0.0, 0.5)))})
    assert space["lr"] == optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)
    assert space["layers"] == optuna.distributions.IntDistribution(1, 4)
    assert space["model"] == optuna.distributions.CategoricalDistribution(["mlp", "cnn"])
    assert space["p"] == optuna.distributions.FloatDistribution(0.0, 0.5)
    # Without Optuna, the error says which extra to install.
    code = "import sys; sys.modules['optuna'] = None\nimport tasks\ntry:\n    tasks.optimize('x', {}, 1, 'y')\n" \
           "except tasks.DeviceFleetError as exc:\n    print(type(exc).__name__, exc)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "MissingExtra" in out.stdout and "devicefleet[sweep]" in out.stdout, out.stderr


@pytest.mark.timeout(120)
def test_optimize_is_an_optuna_study_in_redis_and_prunes_a_poor_trial_early(fleet, app, tmp_path):
    # Trials report their score as the intermediate value 10 times over 3 s. The threshold
    # pruner stops a trial whose value is under 0.5 from step 2 on: the 0.1 trial only. The grid
    # sampler (which calls study.stop() when the grid is done) runs each score once.
    sampler = optuna.samplers.GridSampler({"score": [1.0, 0.1, 0.9, 0.8]}, seed=0)
    pruner = optuna.pruners.ThresholdPruner(lower=0.5, n_warmup_steps=2)
    study = tasks.optimize("counted", {"score": [1.0, 0.1, 0.9, 0.8]}, 4, "score", name="prune-me",
                           kwargs={"marker": str(tmp_path), "seconds": 3.0, "steps": 10},
                           sampler=sampler, pruner=pruner, app=app)

    loaded = optuna.load_study(study_name="prune-me", storage=journal_storage(app))
    by_score = {t.params["score"]: t for t in loaded.trials}
    assert sorted(by_score) == [0.1, 0.8, 0.9, 1.0]
    assert loaded.best_trial.params == {"score": 1.0} and loaded.best_value == 1.0
    pruned = by_score[0.1]
    assert pruned.state == optuna.trial.TrialState.PRUNED
    assert 2 <= max(pruned.intermediate_values) < 10  # stopped early, at a ctx.progress() call
    for score in (1.0, 0.9, 0.8):
        assert by_score[score].state == optuna.trial.TrialState.COMPLETE
        assert by_score[score].value == score
        assert sorted(by_score[score].intermediate_values) == list(range(1, 11))
    assert {t.user_attrs["device"] for t in loaded.trials} == {"cpu0", "cpu1"}
    assert len(study.trials) == 4 and len(_runs(tmp_path)) == 4
    # The pruned trial's device was free for the next trial at once: every trial ran once.
    assert set(_runs(tmp_path).values()) == {1}


@pytest.mark.timeout(120)
def test_cli_sweep_and_optimize_rank_by_the_objective_and_ctrl_c_cancels(fleet, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEFLEET_")}
    env.update(test_env(), DEVICEFLEET_REDIS_URL=fleet.redis_url)
    trials = tmp_path / "trials.jsonl"
    trials.write_text("\n".join(json.dumps({"marker": str(tmp_path), "score": s}) for s in (0.2, 0.9, 0.5)) + "\n")
    out = subprocess.run([*CLI, "sweep", "counted", "--trials", str(trials), "--objective", "score", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    entries = json.loads(out.stdout)["trials"]
    assert [e["kwargs"]["score"] for e in entries] == [0.2, 0.9, 0.5]
    table = subprocess.run([*CLI, "sweep", "counted", "--grid", '{"score": [0.2, 0.9, 0.5]}', "--kwargs",
                            json.dumps({"marker": str(tmp_path)}), "--objective", "score"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    rows = [line.split("│") for line in table.stdout.splitlines() if line.startswith("│")]
    ranked = [cells[5].strip() for cells in rows if cells[1].strip()]  # not a folded line
    assert ranked == ["0.9", "0.5", "0.2"]

    study = subprocess.run([*CLI, "optimize", "counted", "--space", '{"score": {"low": 0.0, "high": 1.0}}',
                            "--trials", "4", "--objective", "score", "--seed", "1", "--name", "cli-study",
                            "--kwargs", json.dumps({"marker": str(tmp_path)}), "--json"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert study.returncode == 0, study.stderr
    report = json.loads(study.stdout)
    assert len(report["trials"]) == 4 and report["study"] == "cli-study"
    assert report["best"]["value"] == max(t["objective"] for t in report["trials"])

    bad = subprocess.run([*CLI, "sweep", "counted", "--grid", '{"score": 1}'], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "grid axis 'score'" in bad.stderr  # refused: nothing sent

    (tmp_path / "long").mkdir()
    long = subprocess.Popen([*CLI, "sweep", "counted", "--grid", '{"score": [1, 2, 3, 4]}', "--json", "--kwargs",
                             json.dumps({"marker": str(tmp_path / "long"), "seconds": 30, "steps": 300})],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list((tmp_path / "long").iterdir())) == 2, 30, "two trials running", proc=long)
    long.send_signal(signal.SIGINT)
    stdout, stderr = long.communicate(timeout=60)
    assert long.returncode == 130, stderr
    assert "cancelling sweep" in stderr
    assert [e["status"] for e in json.loads(stdout)["trials"]] == ["cancelled"] * 4
