"""Packaging that holds: a user's own ``tasks`` module never replaces devicefleet's.

Celery's tutorial starts with a ``tasks.py``. devicefleet's package is named ``tasks`` too, so
every Python process devicefleet starts (workers, Flower, job processes) must import its own
package whatever the working directory holds, and a user's process that meets a shadowing
module says so in one line. (The dependency floors are checked by ``.ci/floors``, which runs
this file too.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tasks
from tasks.core.registry import connect, live_workers
from tasks.core.settings import read_fleet_file
from tasks.core.shadow import PACKAGE, PACKAGE_ROOT, python_child, shadowing_module
from tasks.ops.redis_server import EmbeddedRedis

from .conftest import cli_env, wait_for
from .test_security import scan_an_up_fleet, up_environment

#: The command as users run it (`python -m tasks` in such a folder would run the user's module).
DEVICEFLEET = Path(sys.executable).parent / "devicefleet"
NOTICE = "shadows devicefleet's `tasks` package"

#: Celery's tutorial module, which also records any process that imports it and then exits, so a
#: devicefleet process that picked it up fails loudly instead of running the user's code.
TUTORIAL = '''\
import os
with open({marker!r}, "a") as marker:
    marker.write(f"{{os.getpid()}} {{__file__}}\\n")
from celery import Celery
app = Celery("tasks", broker="redis://localhost:6379/0")
@app.task
def add(x, y):
    return x + y
raise SystemExit(3)
'''

#: A job module in the user's folder, importing devicefleet as ``tasks``.
USER_JOBS = '''\
import os
import sys
from typing import Any
from pydantic import BaseModel
import tasks
from tasks.core.job import JobContext, job

class NoParams(BaseModel):
    pass

@job("where", params=NoParams)
def where(ctx: JobContext, params: NoParams) -> dict[str, Any]:
    return {"tasks": tasks.__file__, "module": __file__, "cwd": os.getcwd(), "safe_path": sys.flags.safe_path}
'''


def user_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A project folder holding Celery's tutorial ``tasks.py``, a ``tasks/`` package of its own
    and a job module; returns it and the file that records imports of the user's ``tasks``."""
    folder = tmp_path / "project"
    (folder / "tasks").mkdir(parents=True)
    marker = tmp_path / "imported-user-tasks.log"
    (folder / "tasks.py").write_text(TUTORIAL.format(marker=str(marker)))
    (folder / "tasks" / "__init__.py").write_text(TUTORIAL.format(marker=str(marker)))
    (folder / "userjobs.py").write_text(USER_JOBS)
    return folder, marker


def test_shadowing_modules_are_found_and_devicefleets_own_package_is_not(tmp_path: Path) -> None:
    module = tmp_path / "module"
    module.mkdir()
    (module / "tasks.py").write_text("")
    package = tmp_path / "package"
    (package / "tasks").mkdir(parents=True)
    (package / "tasks" / "__init__.py").write_text("")
    namespace = tmp_path / "namespace"
    (namespace / "tasks").mkdir(parents=True)  # no __init__.py: never wins over a regular package

    assert shadowing_module(module) == module / "tasks.py"
    assert shadowing_module(package) == package / "tasks"
    assert shadowing_module(namespace) is None
    assert shadowing_module(tmp_path) is None
    assert shadowing_module(PACKAGE_ROOT) is None  # a checkout's own tasks/ is devicefleet
    assert Path(tasks.__file__).resolve() == PACKAGE / "__init__.py"


def test_children_import_devicefleet_before_a_tasks_in_their_folder_or_pythonpath(tmp_path: Path) -> None:
    """The worst case: the shadowing folder is the working directory and on PYTHONPATH, which -P
    alone would not skip. The CLI and Celery's command line (as Flower runs) both load ours."""
    folder, marker = user_folder(tmp_path)
    env = cli_env(PYTHONPATH=str(folder))
    argv, child_env = python_child("tasks", "--version", env=env)
    assert argv[:4] == [sys.executable, "-P", "-m", "tasks"]
    assert child_env["PYTHONPATH"].split(":") == [str(PACKAGE_ROOT), str(folder)]
    version = subprocess.run(argv, env=child_env, cwd=folder, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and "version" in version.stdout, version.stderr

    argv, child_env = python_child("tasks.ops.celery_main", "-A", "tasks", "report", env=env)
    report = subprocess.run(argv, env=child_env, cwd=folder, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "tasks.core.transport:" in report.stdout  # devicefleet's app, not the tutorial's
    assert not marker.exists(), marker.read_text()

    # Without python_child, as the launcher used to start them: the user's module runs.
    plain = subprocess.run([sys.executable, "-m", "tasks", "--version"], env=env, cwd=folder,
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 3 and marker.exists()


def test_a_producer_run_from_such_a_folder_says_so_in_one_line(tmp_path: Path) -> None:
    folder, marker = user_folder(tmp_path)
    (folder / "tasks").rename(tmp_path / "moved")  # only tasks.py is left to shadow
    script = tmp_path / "scripts" / "produce.py"
    script.parent.mkdir()
    script.write_text("import tasks\nprint(tasks.__file__)\n")
    run = subprocess.run([sys.executable, str(script)], env=cli_env(), cwd=folder, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).resolve() == PACKAGE / "__init__.py"
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and NOTICE in lines[0], run.stderr
    assert str(folder / "tasks.py") in lines[0] and "rename it" in lines[0]

    # -P (every process devicefleet starts): the working directory is not looked at; no notice.
    quiet = subprocess.run([sys.executable, "-P", str(script)], env=cli_env(), cwd=folder, capture_output=True,
                           text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_up_and_a_fan_out_from_a_folder_with_its_own_tasks_module_and_package(tmp_path: Path) -> None:
    """As the issue found it: `devicefleet up` in a folder holding Celery's tutorial tasks.py
    (here a tasks/ package too) ended with `worker cpu0 exited with code 0 before joining`.
    Now the workers, Flower and the job processes run devicefleet, the job module in that folder
    still imports, and `up` and `run` each say once that the folder's tasks shadows devicefleet.

    The `up` is given its Redis URL and Flower's login, as a user sets them: tests/test_security.py's
    scan (:func:`~tests.test_security.scan_an_up_fleet`) runs on it too."""
    assert DEVICEFLEET.is_file(), f"no devicefleet command beside {sys.executable}"
    folder, marker = user_folder(tmp_path)
    state = tmp_path / "state"
    redis_server = EmbeddedRedis(tmp_path / "redis")
    redis_server.start()
    given = up_environment(redis_server)
    env = cli_env(DEVICEFLEET_STATE_DIR=str(state), DEVICEFLEET_JOB_MODULES="tasks.jobs,userjobs,tests.fleet_jobs",
                  **given)
    up = subprocess.Popen([str(DEVICEFLEET), "up", "--cpu-workers", "2", "--gpus", "0", "--flower"],
                          cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        info = wait_for(lambda: read_fleet_file(state / "fleet.json"), 120, "the fleet file", proc=up)
        client = connect(info.redis_url)
        try:
            wait_for(lambda: sum(r.ready for r in live_workers(client).values()) == 2, 120,
                     "two ready workers", proc=up)
        finally:
            client.close()
        assert info.flower_url, "Flower did not start"

        run = subprocess.run([str(DEVICEFLEET), "run", "where", "--json"], cwd=folder, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        results = json.loads(run.stdout)
        assert set(results) == {"cpu0", "cpu1"}
        for entry in results.values():
            assert entry["status"] == "ok", entry
            output = entry["output"]
            assert Path(output["tasks"]).resolve() == PACKAGE / "__init__.py"  # devicefleet, in the job
            assert Path(output["module"]).resolve() == (folder / "userjobs.py").resolve()
            assert Path(output["cwd"]).resolve() == folder.resolve() and output["safe_path"] is True
        notices = [line for line in run.stderr.splitlines() if NOTICE in line]
        assert len(notices) == 1 and str(folder / "tasks") in notices[0], run.stderr

        scan_an_up_fleet(up, given, redis_server, tmp_path / "producer")

        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=90)
        assert up.returncode == 0, out
        notices = [line for line in out.splitlines() if NOTICE in line]
        assert len(notices) == 1 and str(folder / "tasks") in notices[0], out
        assert not marker.exists(), f"a devicefleet process imported the user's tasks: {marker.read_text()}"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        # A failed test leaves the pipe that communicate() closes open: the session fixture's
        # gc.collect() then met it (a ResourceWarning, an error after another file's test).
        if up.stdout is not None:
            up.stdout.close()
        redis_server.stop()
