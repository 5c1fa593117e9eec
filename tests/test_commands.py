"""Existing programs on the fleet: ``devicefleet run -- python train.py`` on real workers.

The session fleet (tests/conftest.py) allows ``sys.executable`` and ``bash`` in tests/scripts
(``FLEET_COMMANDS``); the scripts there know nothing of devicefleet but its events pipe.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import psutil
import pytest

import tasks
from tasks import CommandRefused, fan_out
from tasks.core.queues import device_queue

from .conftest import SCRIPTS, cli_env, wait_for

PY = sys.executable


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ok(results: dict[str, dict]) -> None:  # type: ignore[type-arg]
    assert {d: e["status"] for d, e in results.items()} == {d: "ok" for d in results}, results


@pytest.mark.timeout(90)
def test_a_script_with_argparse_runs_on_both_cpu_devices_with_live_lines(app, tmp_path):
    go = tmp_path / "go"
    handle = fan_out(tasks.command([PY, "train.py", "--lr", "0.2", "--steps", "3", "--wait-for", str(go)]),
                     "cpu0,cpu1", app=app)
    seen: list[tuple[str, str, str]] = []
    for device, stream, line in tasks.follow_logs(handle):
        seen.append((device, stream, line))
        # Each script waits for this file after its first line: a line that arrives here before
        # the file exists arrived while the script was still running.
        if {d for d, _, _ in seen} == {"cpu0", "cpu1"} and not go.exists():
            assert not handle.ready()
            go.touch()
    results = handle.get(timeout=60)
    _ok(results)
    for device in ("cpu0", "cpu1"):
        entry = results[device]
        out = entry["output"]
        assert out["loss"] == pytest.approx(0.2 * 10 / 3) and out["lr"] == 0.2  # from its events
        assert out["command"]["exit_code"] == 0 and out["command"]["signal"] is None
        lines = [line for d, stream, line in seen if d == device and stream == "out"]
        first = lines[0]
        assert f"device={device}" in first and "cuda=-1" in first and f"cwd={SCRIPTS}" in first
        worker = tasks.live_devices(app)[device]
        assert f"cores={worker.cores}" in first and f"omp={len(worker.cores)}" in first
        assert lines[1:] == [f"step {s} loss {round(0.2 * 10 / s, 6)}" for s in (1, 2, 3)] + ["done"]
        assert [line for d, stream, line in seen if d == device and stream == "err"] == [
            f"warning {s}" for s in (1, 2, 3)]
        # Kept whole in its artifacts folder, with its curves' event file beside the fan-out's runs.
        log = Path(out["command"]["log"])
        assert (log / "stdout.log").read_text().splitlines() == lines
        assert (log / "stderr.log").read_text() == "warning 1\nwarning 2\nwarning 3\n"
    progress = handle.progress()
    assert {p["step"] for p in progress.values()} == {3} and {p["total"] for p in progress.values()} == {3}


@pytest.mark.timeout(90)
def test_a_failing_script_is_an_error_entry_with_its_last_lines_and_run_exits_non_zero(fleet):
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url)
    script = "for i in $(seq 1 30); do echo line $i; done; echo broken >&2; exit 3"
    done = subprocess.run(["devicefleet", "run", "--devices", "cpu0", "--json", "--", "bash", "-c", script],
                          env=env, capture_output=True, text=True, timeout=80)
    assert done.returncode == 1, done.stderr
    entry = json.loads(done.stdout)["cpu0"]  # stdout is the one JSON document; the lines went to stderr
    assert entry["status"] == "error" and entry["error"]["type"] == "CommandFailed"
    command = entry["error"]["command"]
    assert command["exit_code"] == 3 and command["signal"] is None
    assert command["tail"][-2:] == ["line 30", "broken"] and len(command["tail"]) == 20
    assert "exited with status 3" in entry["error"]["message"]
    assert "[cpu0] line 1\n" in done.stderr and "[cpu0] broken\n" in done.stderr
    # Without --json, the lines come on stdout (stderr's on stderr), after their device.
    plain = subprocess.run(["devicefleet", "run", "--devices", "cpu0", "--", "bash", "-c", "echo hello; exit 4"],
                           env=env, capture_output=True, text=True, timeout=80)
    assert plain.returncode == 1 and "[cpu0] hello" in plain.stdout


@pytest.mark.timeout(60)
def test_a_script_killed_by_a_signal_says_which(app):
    entry = fan_out(tasks.command(["bash", "-c", "echo about to crash; kill -SEGV $$"]), "cpu1",
                    app=app).get(timeout=50)["cpu1"]
    assert entry["status"] == "error" and entry["error"]["type"] == "CommandFailed"
    assert entry["error"]["command"]["signal"] == "SIGSEGV" and entry["error"]["command"]["exit_code"] is None
    assert "killed by SIGSEGV" in entry["error"]["message"]
    assert entry["error"]["command"]["tail"] == ["about to crash"]


@pytest.mark.timeout(90)
def test_cancel_and_time_limit_end_the_command_and_everything_it_started(app, tmp_path):
    # Cancel: a script whose child sleeps; the whole tree goes.
    marker = tmp_path / "child"
    handle = fan_out(tasks.command(["bash", "-c", f"sleep 1000 & echo $! > {marker}; echo started; wait"]),
                     "cpu0", app=app)
    child = int(wait_for(lambda: marker.exists() and marker.read_text().strip(), 30, "the child to start"))
    handle.cancel()
    assert handle.get(timeout=40)["cpu0"]["status"] == "cancelled"
    assert _gone(child)
    # Time limit: a script that ignores SIGTERM, with a child that does too (nohup'd).
    marker2 = tmp_path / "child2"
    script = f"trap '' TERM; nohup sleep 1000 >/dev/null 2>&1 & echo $! $PPID > {marker2}; echo waiting; while true; do sleep 0.1; done"
    entry = fan_out(tasks.command(["bash", "-c", script], options={"time_limit_s": 1.0}), "cpu0",
                    app=app).get(timeout=40)["cpu0"]
    assert entry["status"] == "error" and entry["error"]["type"] == "JobTimeout"
    assert entry["error"]["command"]["signal"] == "SIGKILL"  # it ignored SIGTERM; its last lines are kept too
    assert entry["error"]["command"]["tail"] == ["waiting"]
    child, job_process = (int(pid) for pid in marker2.read_text().split())
    assert _gone(child)
    # The job process ended them itself, before the worker's grace (FLEET_CANCEL_GRACE_S) ran
    # out: it was not killed, and stays warm for the next job.
    assert not _gone(job_process) and job_process in tasks.live_devices(app)["cpu0"].job_pids


@pytest.mark.timeout(120)
def test_a_sweep_of_a_script_reads_each_trials_objective_from_its_output(app):
    grid = tasks.grid({"lr": [0.1, 0.3, 0.5]})
    entries = tasks.sweep(tasks.command([PY, "train.py", "--lr", "{lr}", "--steps", "2"]), grid, "cpu",
                          app=app).get(timeout=100)
    assert [e["status"] for e in entries] == ["ok"] * 3
    assert [e["output"]["loss"] for e in entries] == [pytest.approx(lr * 10 / 2) for lr in (0.1, 0.3, 0.5)]
    assert [e["output"]["command"]["argv"][3] for e in entries] == ["0.1", "0.3", "0.5"]
    # A trial that leaves a placeholder without its parameter is refused before anything is sent.
    with pytest.raises(tasks.ConfigError, match=r"trial 1: .*\{lr\} names no parameter"):
        tasks.sweep(tasks.command([PY, "train.py", "--lr", "{lr}"]), [{"lr": 0.1}, {"seed": 1}], "cpu", app=app)


@pytest.mark.timeout(120)
def test_a_ddp_script_runs_unchanged_as_two_ranks_and_a_crashed_rank_restarts_the_gang(app, tmp_path):
    results = fan_out(tasks.command([PY, "ddp.py"]), "cpu0,cpu1", distributed=True, app=app).get(timeout=100)
    _ok(results)
    for rank, device in enumerate(("cpu0", "cpu1")):
        out = results[device]["output"]
        assert out["sum"] == 3.0 and out["rank"] == rank and out["world_size"] == 2 and out["restarts"] == 0
        env = out["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "2", "0", "1")
        assert env["CUDA_VISIBLE_DEVICES"] == "-1" and env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert env["DEVICEFLEET_DIST_BACKEND"] == "gloo"  # what --backend (auto) chose, for scripts that ask
    # Rank 1's job process dies in the first generation: the gang runs the script again, once.
    results = fan_out(tasks.command([PY, "ddp.py", "--crash-rank", "1", "--marker", str(tmp_path)]), "cpu0,cpu1",
                      distributed=True, app=app).get(timeout=100)
    _ok(results)
    assert {e["output"]["restarts"] for e in results.values()} == {1}
    assert {e["output"]["sum"] for e in results.values()} == {3.0}
    runs = [line.split() for line in (tmp_path / "cpu1").read_text().splitlines()]
    assert [restart for _, restart in runs] == ["0", "1"]


@pytest.mark.timeout(60)
def test_a_distributed_command_that_ends_at_once_ends_ok_on_every_rank(app):
    """Rank 0's job process hosts the gang's store: a command that ends before the other ranks
    are done with the store must not take the store with it (rank 1 could not connect until its
    timeout: a lost peer, and the gang restarting or failing)."""
    # Rank 1 reaches the store half a second after rank 0's command has ended (as a slower
    # rank's last barrier or its destroy_process_group does); a connection is enough to tell.
    code = ("import os, socket, time\n"
            "if os.environ['RANK'] != '0':\n"
            "    time.sleep(0.5)\n"
            "    socket.create_connection((os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT'])), timeout=10).close()\n")
    results = fan_out(tasks.command([PY, "-c", code]), "cpu0,cpu1", distributed=True, app=app).get(timeout=50)
    _ok(results)
    assert {d: e["output"]["restarts"] for d, e in results.items()} == {"cpu0": 0, "cpu1": 0}
    assert {d: e["output"]["rank"] for d, e in results.items()} == {"cpu0": 0, "cpu1": 1}


@pytest.mark.timeout(60)
def test_a_program_the_config_does_not_name_is_refused_at_the_producer_and_at_the_worker(app):
    with pytest.raises(CommandRefused, match=r"program 'perl' is not allowed on cpu0: .*commands.programs"):
        fan_out(tasks.command(["perl", "-e", "1"]), "cpu0", app=app)
    with pytest.raises(CommandRefused, match="outside the folders"):
        fan_out(tasks.command([PY, "train.py"], cwd="/etc"), "cpu0", app=app)
    # A message sent past the producer's check (any Celery client can send one) is refused by
    # the worker before anything starts, naming the rule.
    for kwargs, rule in (({"argv": ["/usr/bin/perl", "-e", "1"]}, "commands.programs"),
                         ({"argv": ["./train.py"]}, "commands.programs"),
                         ({"argv": [PY, "train.py"], "cwd": "../.."}, "commands.workdirs")):
        result = app.send_task("devicefleet.command", kwargs=kwargs, queue=device_queue("cpu0"))
        with pytest.raises(CommandRefused, match=rule):
            result.get(timeout=30)


@pytest.mark.timeout(90)
def test_heavy_output_on_both_streams_never_deadlocks_and_nothing_is_lost(app):
    n = 50_000
    code = f"import sys\nfor i in range({n}):\n    print('o' * 80, i)\n    print('e' * 80, i, file=sys.stderr)"
    handle = fan_out(tasks.command([PY, "-c", code]), "cpu1", app=app)
    counts = {"out": 0, "err": 0}
    for _, stream, _ in tasks.follow_logs(handle):
        counts[stream] += 1
    entry = handle.get(timeout=60)["cpu1"]
    assert entry["status"] == "ok" and entry["output"]["command"]["lines"] == 2 * n
    assert counts == {"out": n, "err": n}
    log = Path(entry["output"]["command"]["log"])
    assert (log / "stdout.log").read_text().count("\n") == n and (log / "stderr.log").read_text().count("\n") == n


@pytest.mark.timeout(60)
def test_a_command_sees_none_of_the_workers_settings_and_cannot_be_given_the_fleets_variables(app):
    code = "import json, os; print(json.dumps(sorted(k for k in os.environ if k.startswith('DEVICEFLEET_'))))"
    entry = fan_out(tasks.command([PY, "-c", code], env={"MY_FLAG": "1"}), "cpu0", app=app).get(timeout=50)["cpu0"]
    log = Path(entry["output"]["command"]["log"])
    names = json.loads((log / "stdout.log").read_text())
    assert "DEVICEFLEET_REDIS_URL" not in names and "DEVICEFLEET_ARTIFACTS_DIR" in names
    with pytest.raises(tasks.ConfigError, match="CUDA_VISIBLE_DEVICES is set by the fleet"):
        tasks.command([PY, "x.py"], env={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(tasks.ConfigError, match="LD_PRELOAD cannot be given: it would make an allowed program"):
        tasks.command([PY, "x.py"], env={"LD_PRELOAD": "/tmp/x.so"})


@pytest.mark.timeout(120)
def test_a_study_of_a_script_prunes_a_poor_trial_by_stopping_its_command(app):
    # Each trial reports its score 10 times over 3 s; the pruner stops one under 0.5 from step 2.
    space = {"score": [1.0, 0.1, 0.9]}
    study = tasks.optimize(tasks.command([PY, "score.py", "--score", "{score}"]), space, 3, "score",
                           sampler=optuna.samplers.GridSampler(space, seed=0),
                           pruner=optuna.pruners.ThresholdPruner(lower=0.5, n_warmup_steps=2), app=app)
    by_score = {t.params["score"]: t for t in study.trials}
    assert by_score[0.1].state == optuna.trial.TrialState.PRUNED
    assert 2 <= max(by_score[0.1].intermediate_values) < 10  # its command was stopped early
    assert {by_score[s].value for s in (1.0, 0.9)} == {1.0, 0.9}
    assert study.best_params == {"score": 1.0}


@pytest.mark.timeout(90)
def test_a_cancelled_distributed_command_ends_every_rank_as_cancelled(app):
    code = "import os, time\nprint('rank', os.environ['RANK'], flush=True)\ntime.sleep(1000)"
    handle = fan_out(tasks.command([PY, "-c", code]), "cpu0,cpu1", distributed=True, app=app)
    seen = set()
    for device, _, line in tasks.follow_logs(handle):
        seen.add((device, line))
        if len(seen) == 2:
            break
    assert seen == {("cpu0", "rank 0"), ("cpu1", "rank 1")}
    handle.cancel()
    results = handle.get(timeout=60)
    assert {d: e["status"] for d, e in results.items()} == {"cpu0": "cancelled", "cpu1": "cancelled"}, results
