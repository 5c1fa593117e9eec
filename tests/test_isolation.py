"""A job can no longer take its device down: each way research code misbehaves, on real workers.

Every job runs in a job process its worker supervises (tasks/worker/supervisor.py). The session
fleet's workers give a job asked to stop ``FLEET_CANCEL_GRACE_S`` to stop at ``ctx.progress()``
and retire a job process grown by ``FLEET_MEMORY_GROWTH_MIB`` (tests/conftest.py); the jobs are
in tests/fleet_jobs.py.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

import tasks
from tasks import fan_out

from .conftest import (
    FLEET_CANCEL_GRACE_S,
    FLEET_MEMORY_GROWTH_MIB,
    cli_env,
    standalone_worker,
    wait_for,
    worker_configs,
)

MiB = 2**20


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _all_gone(*pids: int) -> None:
    """Wait until each of ``pids`` has exited. A process the worker SIGKILLed with the job's
    group, but did not reap itself (the job's subprocess, orphaned; an idle job process killed
    as the worker exits), dies when the kernel next runs it: on a loaded machine, a moment
    after the entry is stored or the worker has exited."""
    wait_for(lambda: all(_gone(pid) for pid in pids), 30, f"processes {list(pids)} to exit",
             poll=0.02)


def _crashed_pid(message: str) -> int:
    match = re.search(r"job process (\d+)", message)
    assert match is not None, message
    return int(match.group(1))


def _hanging(marker: Path) -> tuple[int, int]:
    """Wait until the ``hang`` job wrote its pid and its subprocess's; return both."""
    # The line is whole once it ends: the file exists, empty, from the job's open() on.
    text = wait_for(lambda: marker.exists() and (line := marker.read_text()).endswith("\n") and line, 60,
                    "the job to hang")
    job_pid, sub_pid = (int(p) for p in str(text).split())
    return job_pid, sub_pid


@pytest.mark.timeout(120)
def test_a_job_that_segfaults_or_exits_is_an_error_entry_and_the_next_job_runs(fleet, app):
    before = tasks.live_devices(app)
    handle = fan_out({"cpu0": ("crash", {"how": "segv"}), "cpu1": ("crash", {"how": "exit", "status": 3})}, app=app)
    results = handle.get(timeout=60)
    # The task ends in FAILURE (what Flower shows) and the chord completed.
    assert handle.states() == {"cpu0": "FAILURE", "cpu1": "FAILURE"}
    segv, exited = results["cpu0"]["error"], results["cpu1"]["error"]
    assert segv["type"] == "JobCrashed" and "killed by SIGSEGV" in segv["message"]
    assert exited["type"] == "JobCrashed" and "exit status 3" in exited["message"]
    # The entry ends with the last lines the job printed.
    assert "about to crash (segv)" in segv["message"] and "about to crash (exit)" in exited["message"]

    after = fan_out("echo", ["cpu0", "cpu1"], kwargs={"value": 1}, app=app).get(timeout=60)
    live = tasks.live_devices(app)
    for device, error in (("cpu0", segv), ("cpu1", exited)):
        crashed = _crashed_pid(error["message"])
        assert after[device]["status"] == "ok", after[device]
        assert after[device]["output"]["pid"] != crashed and _gone(crashed)
        assert live[device].pid == before[device].pid, f"{device}'s worker was restarted"


@pytest.mark.timeout(120)
def test_a_hung_job_cancelled_has_its_process_group_ended_and_the_device_takes_the_next(fleet, app, tmp_path):
    marker = tmp_path / "hang"
    handle = fan_out("hang", ["cpu0"], kwargs={"marker": str(marker)}, app=app)
    job_pid, sub_pid = _hanging(marker)
    handle.cancel()
    entry = handle.get(timeout=60)["cpu0"]
    assert entry["status"] == "cancelled" and entry["error"]["type"] == "JobCancelled"
    assert f"did not stop at ctx.progress() within {FLEET_CANCEL_GRACE_S:g} s" in entry["error"]["message"]
    assert handle.states() == {"cpu0": "REVOKED"}
    # The job's process and the subprocess it started (as a DataLoader starts its workers).
    _all_gone(job_pid, sub_pid)
    nxt = fan_out("echo", ["cpu0"], kwargs={"value": 2}, app=app).get(timeout=60)["cpu0"]
    assert nxt["status"] == "ok" and nxt["output"]["pid"] != job_pid


@pytest.mark.timeout(120)
def test_a_hung_job_past_its_time_limit_ends_as_job_timeout(fleet, app, tmp_path):
    marker = tmp_path / "hang"
    handle = fan_out("hang", ["cpu1"], kwargs={"marker": str(marker)}, options={"time_limit_s": 1}, app=app)
    job_pid, sub_pid = _hanging(marker)
    entry = handle.get(timeout=60)["cpu1"]
    assert entry["status"] == "error" and entry["error"]["type"] == "JobTimeout"
    assert "ran past its time limit of 1 s" in entry["error"]["message"]
    assert handle.states() == {"cpu1": "FAILURE"}
    _all_gone(job_pid, sub_pid)
    assert fan_out("echo", ["cpu1"], app=app).get(timeout=60)["cpu1"]["status"] == "ok"


@pytest.mark.timeout(120)
def test_a_leaking_job_costs_its_process_not_the_worker(fleet, app):
    worker = tasks.live_devices(app)["cpu1"].pid
    worker_rss = psutil.Process(worker).memory_info().rss
    mib = FLEET_MEMORY_GROWTH_MIB * 2 // 3  # the second run crosses the threshold
    outputs = [fan_out("leak", ["cpu1"], kwargs={"mib": mib}, app=app).get(timeout=60)["cpu1"]["output"]
               for _ in range(3)]
    first, second, third = outputs
    # The same warm process ran the first two (its global kept growing), then it was retired
    # and a fresh one, with nothing left over, ran the third.
    assert first["pid"] == second["pid"] and second["held_mib"] == 2 * mib
    assert third["pid"] != second["pid"] and third["held_mib"] == mib
    _all_gone(second["pid"])
    # The worker never held any of it.
    assert psutil.Process(worker).memory_info().rss < worker_rss + mib * MiB // 2


@pytest.mark.timeout(120)
def test_a_process_found_broken_after_its_job_hands_the_next_back_to_run_elsewhere_unspent(fleet, app):
    """A job process found broken once its job had ended (a CUDA error that shows only as a
    pack's memory is released) runs nothing more: the next job it is sent gives way, goes back
    to its queue with no attempt spent, and runs in a fresh process; the broken one is retired."""
    from tasks.core import keys
    from tasks.core.registry import connect

    broke = fan_out("break_process", ["cpu0"], app=app).get(timeout=60)["cpu0"]
    assert broke["status"] == "ok" and broke["output"]["runtimes"] == 1, broke
    handle = fan_out("echo", ["cpu0"], kwargs={"value": 7}, app=app)
    entry = handle.get(timeout=60)["cpu0"]
    assert entry["status"] == "ok" and entry["output"]["value"] == 7, entry
    assert entry["output"]["pid"] != broke["output"]["pid"]
    _all_gone(broke["output"]["pid"])
    client = connect(fleet.redis_url)
    try:
        assert client.llen(keys.worker_deaths(handle.jobs()["cpu0"])) == 0  # no attempt spent
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_job_that_rewrites_its_environment_does_not_change_the_next_jobs(fleet, app):
    first = fan_out("environment", ["cpu0"], kwargs={"rewrite": True}, app=app).get(timeout=60)["cpu0"]["output"]
    second = fan_out("environment", ["cpu0"], kwargs={"rewrite": False}, app=app).get(timeout=60)["cpu0"]["output"]
    assert second["pid"] == first["pid"]  # the same process: it was put back between the jobs
    assert second == first
    assert first["cuda_visible_devices"] == "-1" and first["marker"] is None and first["cwd"] != "/"


@pytest.mark.timeout(240)
def test_two_users_alternating_never_share_a_job_process_and_each_reuses_its_own(fleet, app):
    tag = uuid.uuid4().hex[:8]
    alice, bob = f"alice-{tag}", f"bob-{tag}"
    runs = []
    for user in [alice, bob] * 3:
        out = fan_out("remember", ["cpu0"], kwargs={"value": user}, user=user, app=app).get(timeout=120)["cpu0"]
        assert out["status"] == "ok", out["error"]
        runs.append((user, out["output"]["pid"], out["output"]["seen"]))
    pids = {who: {pid for user, pid, _ in runs if user == who} for who in (alice, bob)}
    # No job ran in a process that ran the other user's: it found only its own user's values.
    assert not pids[alice] & pids[bob], runs
    assert all(set(seen) <= {user} for user, _, seen in runs), runs
    # Each user's jobs ran warm in one process (the device keeps one other user's warm), the
    # first in a spare that had run no job.
    assert len(pids[alice]) == 1 and len(pids[bob]) == 1, runs
    for who in (alice, bob):
        assert [seen for user, _, seen in runs if user == who] == [[], [who], [who, who]], runs


def test_the_worker_process_never_loads_torch_its_job_processes_do(fleet, app):
    for device, record in tasks.live_devices(app).items():
        maps = Path(f"/proc/{record.pid}/maps").read_text()
        assert "libtorch" not in maps, f"{device}'s worker loaded torch"
        alive = [pid for pid in record.job_pids if not _gone(pid)]
        assert alive, f"{device} lists no live job process: {record.job_pids}"
        assert all("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in alive)


@pytest.mark.timeout(120)
def test_a_stopping_worker_ends_a_hung_job_after_its_stop_timeout(fleet, app, tmp_path):
    configs = worker_configs(tmp_path / "configs", cancel_grace_s=1.0, stop_timeout_s=1)
    argv = [sys.executable, "-m", "tasks", "worker", "cpu8"]
    with standalone_worker(fleet, "cpu8", argv, tmp_path / "cpu8.log", DEVICEFLEET_WORKER_CONFIGS_DIR=str(configs),
                           DEVICEFLEET_STATE_DIR=str(tmp_path / "state")) as (proc, record):
        marker = tmp_path / "hang"
        handle = fan_out("hang", ["cpu8"], kwargs={"marker": str(marker)}, app=app)
        job_pid, sub_pid = _hanging(marker)
        job_processes = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGTERM)  # systemctl stop
        entry = handle.get(timeout=60)["cpu8"]
        assert entry["status"] == "error" and entry["error"]["type"] == "WorkerStopped"
        assert "stop timeout of 1 s" in entry["error"]["message"]
        assert proc.wait(60) == 0
        # Nothing the worker started outlives it.
        _all_gone(job_pid, sub_pid, *(p.pid for p in job_processes))
        assert record.pid == proc.pid


@pytest.mark.timeout(120)
def test_ctrl_c_on_run_cancels_a_hung_job_and_exits(fleet, app, tmp_path):
    marker = tmp_path / "hang"
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url)
    run = subprocess.Popen([sys.executable, "-m", "tasks", "run", "hang", "--devices", "cpu1", "--no-progress",
                            "--json", "--kwargs", f'{{"marker": "{marker}"}}'], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_pid, sub_pid = _hanging(marker)
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    assert "cancelling the fan-out" in err
    entry = json.loads(out)["cpu1"]
    assert entry["status"] == "cancelled"
    _all_gone(job_pid, sub_pid)
    assert fan_out("echo", ["cpu1"], app=app).get(timeout=60)["cpu1"]["status"] == "ok"
