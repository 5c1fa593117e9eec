"""The command line as a newcomer meets it: `status` into a pipe and `status --url`, and a
`devicefleet run` waiting while its `devicefleet up` stops (killed here; warm: at the end of
tests/test_cli.py::test_up_run_status_and_clean_stop)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from celery.backends.asynchronous import E_RETRY_LIMIT_EXCEEDED
from kombu.exceptions import OperationalError

from tasks.core.errors import EXIT_FLEET_LOST, FleetLost
from tasks.core.registry import connect, live_workers
from tasks.ops.fleet_lost import watching_the_fleet

from .conftest import cli_env, make_settings, wait_for
from .test_cli import busy_devices

CLI = [sys.executable, "-m", "tasks"]


@pytest.mark.timeout(60)
def test_status_url_prints_the_url_whole_and_only_on_request(fleet):
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url)
    url = subprocess.run([*CLI, "status", "--url"], env=env, capture_output=True, text=True, timeout=30)
    assert url.returncode == 0 and url.stdout == f"{fleet.redis_url}\n", url.stderr
    shown = subprocess.run([*CLI, "status", "--json"], env=env, capture_output=True, text=True, timeout=30)
    password = fleet.redis_url.split(":")[2].split("@")[0]
    assert shown.returncode == 0 and password and password not in shown.stdout
    both = subprocess.run([*CLI, "status", "--url", "--json"], env=env, capture_output=True, text=True, timeout=30)
    assert both.returncode == 2 and "Error: --url prints the URL alone" in both.stderr


@pytest.mark.timeout(60)
def test_status_watch_into_a_pipe_prints_a_frame_every_interval(fleet):
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url, COLUMNS="100")
    watch = subprocess.Popen([*CLI, "status", "--watch", "--interval", "0.2"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        frames: list[list[str]] = []
        while len(frames) < 3:  # each frame is there as it is printed, not when the command ends
            line = watch.stdout.readline()
            assert line, f"status --watch ended: {watch.communicate(timeout=10)}"
            if line.startswith("-- "):
                frames.append([])
            elif frames:
                frames[-1].append(line)
        assert watch.poll() is None  # still watching
        for frame in frames[:2]:  # complete frames: each shows the fleet
            text = "".join(frame)
            assert "live device(s)" in text and "cpu0" in text and "cpu1" in text, text
    finally:
        watch.terminate()
        watch.communicate(timeout=10)


@contextmanager
def _a_run_on_up(tmp_path: Path, busy_s: float, *options: str) -> Iterator[tuple[subprocess.Popen[str], ...]]:
    """`devicefleet up` (two CPU workers, ``options``) and a `devicefleet run --json` of a probe
    that sleeps ``busy_s`` on each; yields ``(up, run)`` once both jobs run, and kills both on
    the way out if they still run."""
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path))
    up = subprocess.Popen([*CLI, "up", "--cpu-workers", "2", "--gpus", "0", "--no-flower", *options], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = [up]
    fleet_file = tmp_path / "fleet.json"

    def ready() -> bool:
        if not fleet_file.exists():
            return False
        with connect(json.loads(fleet_file.read_text())["redis_url"]) as client:
            workers = live_workers(client)
        return len(workers) == 2 and all(record.ready for record in workers.values())

    try:
        wait_for(ready, 120, "two ready workers", proc=up)
        url = json.loads(fleet_file.read_text())["redis_url"]
        run = subprocess.Popen([*CLI, "run", "probe", "--kwargs", json.dumps({"busy_s": busy_s, "mode": "sleep"}),
                                "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(run)
        wait_for(lambda: busy_devices(url) == {"cpu0", "cpu1"}, 60, "both jobs to start", proc=run)
        yield up, run
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=30)


# A warm stop of `up` with a `run` waiting on both its jobs: the end of
# tests/test_cli.py::test_up_run_status_and_clean_stop (one `up` for both).


@pytest.mark.timeout(180)
def test_a_run_whose_fleet_stops_before_its_jobs_end_says_so_in_one_line(tmp_path):
    """The jobs outlast `up`'s stop timeout: the workers are killed, no entry comes, Redis stops.
    `run` says so in one line and exits 3 within seconds (not after two minutes of retries)."""
    with _a_run_on_up(tmp_path, 60, "--stop-timeout", "1") as (up, run):
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)
        stopped = time.monotonic()
        out, err = run.communicate(timeout=30)
        assert time.monotonic() - stopped < 10, err
        assert run.returncode == EXIT_FLEET_LOST, err
        # One message (wrapped at the console's width), nothing else: no retries, no traceback.
        assert err.startswith("Error: the fleet stopped while waiting for the fan-out"), err
        assert err.count("Error") == 1 and "Traceback" not in err and "Retry" not in err and out == "", err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lost", [RuntimeError(E_RETRY_LIMIT_EXCEEDED), redis.ConnectionError("Connection refused"),
                                  OperationalError("Connection refused")])
def test_a_redis_lost_past_the_retries_is_fleet_lost_naming_the_fleet(tmp_path, lost):
    """Where the fleet is not a local `up`'s (a URL given), what Celery and redis-py raise once
    their retries are spent becomes one FleetLost, its URL's password masked."""
    settings = make_settings(tmp_path, redis_url="redis://:secret@127.0.0.1:1/0")
    with pytest.raises(FleetLost, match=r"lost the fleet's Redis \(redis://:\*\*\*@127.0.0.1:1/0\) while waiting "
                                        "for the fan-out") as caught, watching_the_fleet(settings, "the fan-out"):
        raise lost
    assert "secret" not in str(caught.value)
    with pytest.raises(RuntimeError, match="not Redis"), watching_the_fleet(settings, "the fan-out"):
        raise RuntimeError("not Redis")
