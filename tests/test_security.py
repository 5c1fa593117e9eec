"""User code holds no key to the fleet: a job looks for the fleet's Redis URL and password and
finds nothing to open Redis with.

The session fleet's workers are started as deployed workers are: ``DEVICEFLEET_REDIS_URL``, with
the embedded Redis's password, in their environment. A ``@job`` (``snoop``, tests/fleet_jobs.py)
and a command (tests/scripts/snoop.py) look through their environment, arguments, their own and
their parent's ``/proc`` environ and cmdline, and every open file descriptor (its target, and a
regular file's contents); they try every Redis URL they see. From the outside (psutil), their job
process has no socket to the fleet's Redis.
"""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import unquote, urlsplit

import psutil
import pytest

import tasks
from tasks import fan_out

from .conftest import SCRIPTS

PY = sys.executable


def _secrets(url: str) -> list[str]:
    password = urlsplit(url).password
    assert password, f"the session fleet's Redis has a password, as deployed: {url!r}"
    return [url, password, unquote(password)]


def _redis_port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def _sockets_to(pid: int, port: int) -> list[Any]:
    """The TCP connections of process ``pid`` whose far end is ``port``."""
    return [c for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr and c.raddr.port == port]


def _assert_found_nothing(report: dict[str, Any]) -> None:
    assert report["found"] == [], report
    assert report["urls"] == [] and report["reached"] == [], report
    # It did read what it looked at (not a scan that saw nothing because it could read nothing).
    assert {"os.environ", "/proc/self/environ", "/proc/self/cmdline"} <= set(report["read"]), report


@pytest.mark.timeout(90)
def test_a_job_finds_no_key_to_the_fleets_redis_and_its_process_has_no_socket_to_it(fleet, app):
    secrets = _secrets(fleet.redis_url)
    entry = fan_out("snoop", "cpu0", kwargs={"needles": secrets}, app=app).get(timeout=60)["cpu0"]
    assert entry["status"] == "ok", entry
    report = entry["output"]["snoop"]
    _assert_found_nothing(report)
    # Its parent is the worker, whose environment holds the URL: closed to the job process (or,
    # to root, which may read it, without the secrets).
    worker = tasks.live_devices(app)["cpu0"]
    assert report["ppid"] == worker.pid
    assert "/proc/parent/environ" in {*report["read"], *report["closed"]}, report
    # The job process (still warm, for the next job) has no connection to the fleet's Redis,
    # while its worker does.
    assert report["pid"] in tasks.live_devices(app)["cpu0"].job_pids
    port = _redis_port(fleet.redis_url)
    assert _sockets_to(report["pid"], port) == []
    assert _sockets_to(worker.pid, port) != []


@pytest.mark.timeout(90)
def test_a_command_finds_no_key_to_the_fleets_redis_and_its_job_process_has_no_socket_to_it(fleet, app,
                                                                                             tmp_path):
    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps(_secrets(fleet.redis_url)))
    entry = fan_out(tasks.command([PY, "snoop.py", str(needles)], cwd=str(SCRIPTS)), "cpu1",
                    app=app).get(timeout=60)["cpu1"]
    assert entry["status"] == "ok", entry
    report = entry["output"]["snoop"]
    _assert_found_nothing(report)
    # Its parent is its job process, which holds nothing of the fleet's either.
    assert "/proc/parent/environ" in report["read"], report
    job_process = report["ppid"]
    assert job_process in tasks.live_devices(app)["cpu1"].job_pids
    assert _sockets_to(job_process, _redis_port(fleet.redis_url)) == []
