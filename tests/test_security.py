"""User code holds no key to the fleet: a job looks for the fleet's Redis URL and password and
finds nothing to open Redis with.

The session fleet's workers are started as deployed workers are: ``DEVICEFLEET_REDIS_URL``, with
the embedded Redis's password, in their environment. A ``@job`` (``snoop``, tests/fleet_jobs.py)
and a command (tests/scripts/snoop.py) look through their environment, arguments, their own and
their parent's ``/proc`` environ and cmdline, and every open file descriptor (its target, and a
regular file's contents); they try every Redis URL they see. They also read the ``/proc`` environ
and cmdline of every other process of their user they can see: no process of the fleet (the
launcher, Flower, the exporter, the workers) shows them a key, whether or not they are root
(root reads a non-dumpable process's environ, which holds stars where the secrets were). From
the outside (psutil), their job process has no socket to the fleet's Redis.

What a job of the same user can still read, and no process can hide: that user's files (a local
fleet's ``fleet.json`` and its embedded Redis's config). tests/test_systemd.py runs the same scan
on a deployed host, where the workers run as their own user and the environment files are
closed to them.
"""

from __future__ import annotations

import json
import os
import secrets as tokens
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psutil
import pytest

import tasks
from tasks import fan_out
from tasks.core.app import create_app
from tasks.core.hiding import environment_secrets, login_secrets
from tasks.core.settings import Settings
from tasks.ops.redis_server import EmbeddedRedis

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


def _seen(report: dict[str, Any]) -> set[int]:
    """The other processes of its user the scan looked at (and its parent, which it reads apart)."""
    return {int(pid) for pid in report["processes"]} | {report["ppid"]}


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
    # It looked at every process of the fleet, which runs as its user: the launcher (this test's
    # process, which runs the exporter too), Redis, both workers; none showed it a secret.
    assert fleet.redis is not None and fleet.redis.process is not None
    fleet_pids = {os.getpid(), fleet.redis.process.pid, *(r.pid for r in tasks.live_devices(app).values())}
    assert fleet_pids <= _seen(report), report["processes"]


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


def up_environment(redis_server: EmbeddedRedis) -> dict[str, str]:
    """What a user sets for a `devicefleet up` that :func:`scan_an_up_fleet` scans: its Redis URL
    and Flower's login (the job modules are the caller's: they must include tests.fleet_jobs)."""
    return {"DEVICEFLEET_REDIS_URL": redis_server.url, "FLOWER_BASIC_AUTH": f"admin:{tokens.token_urlsafe(18)}"}


def scan_an_up_fleet(up: subprocess.Popen[Any], env: dict[str, str], redis_server: EmbeddedRedis,
                     state: Path) -> None:
    """No process of an `up` fleet shows a job its Redis URL or Flower's login: `devicefleet up`
    given both in its environment (:func:`up_environment`), as a user sets them, and started
    with Flower and two CPU workers: the launcher (which runs the exporter), Flower and the
    workers all hold them, and a job that reads every process of its user finds them in none.

    tests/test_packaging.py runs it on its `up` once the fleet is up (one `up`, some 20 s to
    start and stop on a 2-core host, for both tests); ``state``: a folder for the producer."""
    url, login = env["DEVICEFLEET_REDIS_URL"], env["FLOWER_BASIC_AUTH"]
    needles = [*_secrets(url), login, login_secrets(login)[-1]]
    flower = [p.pid for p in psutil.Process(up.pid).children(recursive=True) if "flower" in p.cmdline()]
    assert len(flower) == 1, flower
    app = create_app(Settings.load(redis_url=url, state_dir=state, job_modules=["tasks.jobs", "tests.fleet_jobs"]))
    try:
        entry = fan_out("snoop", "cpu0", kwargs={"needles": needles}, app=app).get(timeout=60)["cpu0"]
        assert entry["status"] == "ok", entry
        report = entry["output"]["snoop"]
        _assert_found_nothing(report)
        # Nor its own environment (the launcher keeps Flower's login from its workers). It looked
        # at every process of the fleet.
        workers = {record.pid for record in tasks.live_devices(app).values()}
        assert len(workers) == 2 and redis_server.process is not None
        assert {up.pid, flower[0], *workers, redis_server.process.pid} <= _seen(report), report["processes"]
    finally:
        app.close()


# tests/test_packaging.py::test_up_and_a_fan_out_from_a_folder_with_its_own_tasks_module_and_package
# runs scan_an_up_fleet on its `up`: no process of an up fleet shows a job its Redis URL or
# Flower's login.


def test_the_secrets_a_fleet_process_hides_are_its_redis_urls_and_flowers_login() -> None:
    assert login_secrets("admin:pw-one-1,bob:pw-two-2") == ["admin:pw-one-1,bob:pw-two-2", "pw-one-1", "pw-two-2"]
    assert login_secrets(None) == [] and login_secrets("a:b") == []  # too short to look for
    env = {"DEVICEFLEET_REDIS_URL": "redis://:p%40ssword@h:6379/0", "FLOWER_BASIC_AUTH": "admin:flowerpw",
           "HOME": "/root"}
    assert environment_secrets(env) == ["redis://:p%40ssword@h:6379/0", "p%40ssword", "p@ssword",
                                        "admin:flowerpw", "flowerpw"]
    assert environment_secrets({"HOME": "/root"}) == []


def test_the_mps_daemon_a_gpu_worker_starts_gets_no_key_to_the_fleet(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The MPS control daemon outlives no worker but runs as the jobs' user, dumpable: its
    environment is the worker's less the fleet's keys (a stand-in daemon records what it got)."""
    from tasks.core.devices import Device, DeviceKind
    from tasks.worker.mps import MpsServer

    url = f"redis://:{tokens.token_urlsafe(12)}@127.0.0.1:6379/0"
    monkeypatch.setenv("DEVICEFLEET_REDIS_URL", url)
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "admin:flower-secret")
    monkeypatch.setenv("MY_COPY", url)
    monkeypatch.setenv("DATASETS", "/data")
    program = tmp_path / "bin" / "nvidia-cuda-mps-control"
    program.parent.mkdir()
    program.write_text('#!/bin/sh\nif [ "$1" = "-d" ]; then env > "$CUDA_MPS_PIPE_DIRECTORY/../env"; fi\n')
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    server = MpsServer(Device(DeviceKind.GPU, 0), tmp_path / "state")
    monkeypatch.setattr(server, "gpu_uuid", lambda: "GPU-0000")  # torch's answer on a GPU host
    server.start(None)
    server.stop()
    got = (server.folder / "env").read_text()
    assert "DATASETS=/data" in got and "CUDA_VISIBLE_DEVICES=GPU-0000" in got
    assert not [needle for needle in [*_secrets(url), "flower-secret"] if needle in got], got
