"""Nothing `devicefleet up` starts outlives it, and its own stop is bounded (real processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tasks.core.children import spawn_child

from .conftest import cli_env, wait_for
from .test_cli import CLI, _ready_workers


def _start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`devicefleet up` with one CPU worker in ``tmp_path``, its output in a file (returned)."""
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path / "state"),
               DEVICEFLEET_JOB_MODULES="tasks.jobs,tests.fleet_jobs")
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([*CLI, "up", "--cpu-workers", "1", "--gpus", "0", *args], env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    return up, log


def _wait_up(up: subprocess.Popen[bytes], log: Path) -> list[psutil.Process]:
    """Wait until `up` says the fleet is up (Redis answers, Flower answers, the worker is ready),
    and return every process it started."""
    wait_for(lambda: "fleet up" in log.read_text(errors="replace"), 120, "`up` to start its fleet", proc=up)
    return psutil.Process(up.pid).children(recursive=True)


def _kill_left(procs: list[psutil.Process]) -> None:
    """A failed test must not leave the processes it asserts about running."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.timeout(180)
def test_sigkill_of_up_takes_redis_flower_and_workers_with_it(tmp_path):
    """As the issue found it: `up` killed by SIGKILL (a service manager's last resort) runs none
    of its cleanup; the kernel's parent-death signal still ends everything it started."""
    up, log = _start_up(tmp_path)
    children: list[psutil.Process] = []
    try:
        children = _wait_up(up, log)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "redis-server" in names and "flower" in names and "worker cpu0" in names, names
        up.kill()
        up.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"left running after `up` was killed: {alive}"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        _kill_left(children)


@pytest.mark.timeout(180)
def test_sigterm_to_up_with_a_hung_job_ends_within_the_stop_timeout(tmp_path):
    """A job that never ends holds its worker's warm stop for ever: `up` kills the worker's
    process group after --stop-timeout and is done a few seconds later, leaving nothing."""
    stop_timeout = 2.0
    up, log = _start_up(tmp_path, "--no-flower", "--stop-timeout", str(stop_timeout))
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path / "state"))
    children: list[psutil.Process] = []
    run: subprocess.Popen[bytes] | None = None
    try:
        children = _wait_up(up, log)
        # From another process, as a user would: a producer in this one would try, for minutes,
        # to reach the gone Redis when it drops the job's never-finished result.
        hung = json.dumps({"steps": 1, "release_file": str(tmp_path / "never"), "timeout_s": 3600})
        run = subprocess.Popen([*CLI, "run", "hold", "--devices", "cpu0", "--kwargs", hung], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: any(slot["busy"] for slot in _ready_workers(env).get("cpu0", {}).get("slots", [])), 60,
                 "cpu0 to run the hung job")
        began = time.monotonic()
        up.send_signal(signal.SIGTERM)
        code = up.wait(stop_timeout + 10)
        took = time.monotonic() - began
        output = log.read_text(errors="replace")
        assert code == 0, output
        assert "cpu0 still running after 2 s; killing it" in output
        assert took < stop_timeout + 8, f"`up` took {took:.1f} s to stop"
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"left running after `up` stopped: {alive}"
    finally:
        for proc in (up, run):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        _kill_left(children)


@pytest.mark.timeout(30)
def test_a_child_started_from_a_thread_outlives_the_thread(tmp_path):
    """The parent-death signal fires when the *thread* that forked the child ends: a worker that
    a supervisor thread restarted must not die when that thread does."""
    started: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: started.append(spawn_child(["sleep", "60"])))
    thread.start()
    thread.join()
    child = started[0]
    try:
        # A death signal would have arrived as the thread ended: give it time to, bounded.
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(1)
    finally:
        child.kill()
        child.wait()
