"""The command line, run as users run it: real subprocesses, real fleets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import redis

import tasks
from tasks.core.app import create_app
from tasks.core.devices import count_gpus
from tasks.core.registry import connect, live_workers
from tasks.core.settings import Settings, read_fleet_file
from tasks.ops.proc import free_port
from tasks.ops.redis_server import find_redis_server

from .conftest import cli_env, standalone_worker, wait_for

CLI = [sys.executable, "-m", "tasks"]


def _ready_workers(env: dict[str, str]) -> dict[str, dict]:  # type: ignore[type-arg]
    """The ready workers `devicefleet status --json` shows (none while there is no fleet)."""
    out = subprocess.run([*CLI, "status", "--json"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {}
    return {d: w for d, w in json.loads(out.stdout)["workers"].items() if w.get("ready")}


def _wait_ready_workers(state_dir: Path, env: dict[str, str], up: subprocess.Popen[str],
                        count: int = 2) -> dict[str, dict]:  # type: ignore[type-arg]
    """Wait until `up`'s fleet (its fleet file in ``state_dir``) has ``count`` ready workers,
    watching its registry from this process, then return the ready workers `devicefleet status
    --json` shows. Polling `status` itself would start an interpreter every 50 ms on the cores
    the fleet's workers start on."""
    info = wait_for(lambda: read_fleet_file(state_dir / "fleet.json"), 60, "`up` to write its fleet file", proc=up)
    with connect(info.redis_url) as client:
        wait_for(lambda: sum(r.ready for r in live_workers(client).values()) == count, 120,
                 f"{count} ready workers in the registry", proc=up)
    return _ready_workers(env)


def busy_devices(url: str) -> set[str]:
    """The devices whose worker runs a job, in the registry of the fleet at ``url``."""
    with connect(url) as client:
        return {device for device, record in live_workers(client).items() if record.busy is not None}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(180)
def test_up_run_status_and_clean_stop(tmp_path):
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path), DEVICEFLEET_JOB_MODULES="tasks.jobs,tests.fleet_jobs")
    up = subprocess.Popen([*CLI, "up", "--cpu-workers", "2", "--gpus", "0"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    waiting: subprocess.Popen[str] | None = None
    try:
        workers = _wait_ready_workers(tmp_path, env, up)
        assert set(workers) == {"cpu0", "cpu1"}  # `devicefleet status` shows both ready
        assert all(w["cuda_visible_devices"] == "-1" for w in workers.values())
        fleet_file = tmp_path / "fleet.json"
        assert fleet_file.stat().st_mode & 0o777 == 0o600  # it holds the Redis password
        redis_url = json.loads(fleet_file.read_text())["redis_url"]
        assert redis_url.startswith("redis://:") and "@127.0.0.1:" in redis_url

        run = subprocess.run([*CLI, "run", "probe", "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        results = json.loads(run.stdout)
        assert set(results) == {"cpu0", "cpu1"} and all(e["status"] == "ok" for e in results.values())

        table = subprocess.run([*CLI, "run", "probe", "--devices", "cpu1"], env=env, capture_output=True, text=True, timeout=120)
        assert table.returncode == 0 and "cpu1" in table.stdout and "ok" in table.stdout

        # Its refusals (an unknown device, bad --kwargs, a typo in them) and a failed job's exit
        # status: tests/test_refusals.py, each against a fleet, in process.

        # A warm stop while both jobs of a `run` still run: they finish, the fan-out's collect
        # step runs (no worker takes it any more: the launcher does, before Redis stops) and
        # `run` prints both.
        waiting = subprocess.Popen([*CLI, "run", "probe", "--kwargs", json.dumps({"busy_s": 3, "mode": "sleep"}),
                                    "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: busy_devices(redis_url) == {"cpu0", "cpu1"}, 60, "both jobs to start", proc=waiting)
        pids = [w["pid"] for w in workers.values()]
        up.send_signal(signal.SIGTERM)
        waited, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert {device: entry["status"] for device, entry in json.loads(waited).items()} == {"cpu0": "ok", "cpu1": "ok"}
        out, _ = up.communicate(timeout=90)
        assert up.returncode == 0, out
        assert "fleet stopped" in out
        assert not any(_pid_alive(pid) for pid in pids)
        assert not fleet_file.exists()
        after = subprocess.run([*CLI, "status"], env=env, capture_output=True, text=True)
        assert after.returncode == 3 and "devicefleet up" in after.stderr  # no fleet to reach
    finally:
        for process in (waiting, up):
            if process is not None and process.poll() is None:
                process.kill()
                process.communicate()


def _redis_server_of(up: subprocess.Popen[str]) -> psutil.Process | None:
    """The running redis-server `up` started, if there is one (a zombie does not count)."""
    found = []
    for proc in psutil.Process(up.pid).children(recursive=True):
        try:
            if "redis-server" in proc.name() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:  # it ended between the listing and the look
            continue
    assert len(found) <= 1, found
    return found[0] if found else None


@pytest.mark.timeout(180)
def test_up_restarts_its_killed_redis_and_a_fan_out_in_flight_completes(tmp_path):
    """As it was found: `devicefleet up`, a fan-out in flight, `kill -9` of the fleet's
    redis-server. `up` reaps and restarts it on the same port from its append-only file, the
    producer and the workers ride through and the results arrive; then, with Redis killed again,
    one SIGTERM stops `up` within its stop timeout."""
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path))
    up = subprocess.Popen([*CLI, "up", "--cpu-workers", "2", "--gpus", "0", "--no-flower", "--stop-timeout", "30"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert len(_wait_ready_workers(tmp_path, env, up)) == 2
        redis_url = json.loads((tmp_path / "fleet.json").read_text())["redis_url"]
        app = create_app(Settings.load(redis_url=redis_url, state_dir=tmp_path / "producer"))
        pids = [r.pid for r in tasks.live_devices(app).values()]
        handle = tasks.fan_out("probe", "cpu0,cpu1", kwargs={"busy_s": 6, "mode": "sleep"}, app=app)
        wait_for(lambda: set(handle.states().values()) == {"STARTED"}, 60, "both jobs to start")
        first = _redis_server_of(up)
        assert first is not None
        first.kill()
        # Reaped (no zombie) and running again, a new process on the same port.
        wait_for(lambda: not first.is_running(), 10, "the killed redis-server to be reaped (not a zombie)")
        second = wait_for(lambda: _redis_server_of(up), 30, "up to start redis-server again")
        assert second.pid != first.pid
        results = handle.get(timeout=90)
        assert {d: e["status"] for d, e in results.items()} == {"cpu0": "ok", "cpu1": "ok"}
        assert [r.pid for r in tasks.live_devices(app).values()] == pids  # the workers rode through
        again = tasks.fan_out("probe", "all", app=app).get(timeout=60)
        assert {d: e["status"] for d, e in again.items()} == {"cpu0": "ok", "cpu1": "ok"}

        second.kill()
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
        assert up.returncode == 0, out
        assert "restarting it on port" in out and "fleet stopped" in out
        assert not any(_pid_alive(pid) for pid in pids)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.skipif(count_gpus() > 0, reason="this host has a GPU")
def test_gpu_worker_refuses_to_start_without_its_gpu(fleet):
    proc = subprocess.run([*CLI, "worker", "gpu0"], env=cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "gpu0" in output and "not visible" in output and "refusing to start" in output
    assert "gpu0" not in tasks.live_devices(fleet.app())


def test_worker_with_a_bad_name_says_so(fleet):
    proc = subprocess.run([*CLI, "worker", "tpu0"], env=cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "'tpu0' is not a device name" in proc.stderr


@pytest.mark.timeout(120)
def test_plain_celery_worker_command_joins_the_fleet(fleet, app, tmp_path):
    # The README's command, with no pool options: the app's settings choose the threads pool.
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-n", "cpu7@%h"]
    with standalone_worker(fleet, "cpu7", argv, tmp_path / "cpu7.log") as (proc, record):
        assert record.queues == ["device.cpu7", "cpu", "fleet"]
        assert record.cuda_visible_devices == "-1"
        assert record.pid == proc.pid and record.pool == "threads"
        entry = tasks.fan_out("probe", ["cpu7"], app=app).get(timeout=60)["cpu7"]
        # It ran in one of the worker's own job processes (started by the worker, not forked by a pool).
        assert entry["status"] == "ok" and entry["output"]["pid"] in record.job_pids
        assert psutil.Process(entry["output"]["pid"]).ppid() == proc.pid
        assert entry["output"]["env"]["CUDA_VISIBLE_DEVICES"] == "-1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a warm shutdown
        client = connect(fleet.redis_url)
        assert "cpu7" not in live_workers(client)  # left the registry on shutdown
        client.close()


@pytest.mark.timeout(240)
def test_demo_json_prints_two_ok_devices_that_learned(tmp_path):
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.run([*CLI, "demo", "--json"], env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert len(results) >= 2
    for entry in results.values():
        assert entry["status"] == "ok", entry
        assert entry["output"]["accuracy"] >= 0.9
        assert Path(entry["output"]["checkpoint"]).is_file()
    assert len({e["output"]["checkpoint"] for e in results.values()}) == len(results)


@pytest.mark.timeout(180)
def test_sigterm_to_demo_stops_its_fleet(tmp_path):
    """SIGTERM (a CI runner or a service manager stopping it) acts as Ctrl-C: the demo's
    redis-server and workers stop with it instead of being orphaned."""
    import psutil

    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path / "state"))
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        demo = subprocess.Popen([*CLI, "demo", "--epochs", "1000"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "fleet ready" in log.read_text(errors="replace"), 120, "the demo's fleet", proc=demo)
        children = psutil.Process(demo.pid).children(recursive=True)
        assert len(children) >= 3, children  # redis-server and two workers at least
        demo.send_signal(signal.SIGTERM)
        demo.wait(60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {alive}"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def test_demo_wait_ends_on_sigterm_even_if_its_interrupt_was_swallowed(monkeypatch):
    """A KeyboardInterrupt that the SIGTERM handler raises inside a finalizer (redis-py's
    ``ConnectionPool.__del__``) is swallowed by Python; seen once on CI, the demo then ran on and
    its fleet was orphaned. The demo's wait notices SIGTERM by itself within a second."""
    from tasks.cli import fleet as cli_module
    from tasks.core.errors import FanOutTimeout

    class StillRunning:
        calls = 0

        def get(self, timeout: float) -> None:
            self.calls += 1
            assert timeout <= 1.0
            if self.calls == 2:
                cli_module._terminated.set()  # SIGTERM came; its KeyboardInterrupt was lost
            raise FanOutTimeout(timeout, ["cpu0"])

    monkeypatch.setattr(cli_module, "_terminated", threading.Event())
    handle = StillRunning()
    with pytest.raises(KeyboardInterrupt):
        cli_module._get_unless_terminated(handle, 600)
    assert handle.calls == 2


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_fan_out_cpu_and_gpu0(fleet, app):
    results = tasks.fan_out({"cpu0": ("train", {"epochs": 10}), "gpu0": ("train", {"epochs": 10})},
                            app=app).get(timeout=280)
    gpu = results["gpu0"]
    assert gpu["status"] == "ok", gpu["error"]
    assert gpu["visibility"]["cuda_visible_devices"] == "0"
    assert gpu["visibility"]["cuda_available"] is True
    assert gpu["output"]["torch_device"] == "cuda:0"
    assert gpu["output"]["accuracy"] >= 0.9
    assert results["cpu0"]["visibility"]["cuda_available"] is False


# -- Celery's own commands and errors a new user meets -------------------------------------------

CELERY = [sys.executable, "-m", "celery", "-A", "tasks"]


def test_each_command_is_loaded_from_its_group_module_and_a_command_loads_only_its_own():
    """The command is one module per command group (tasks/cli/, as rq's rq/cli/): the group's map
    names every top-level command each module defines, and running one imports its module alone."""
    import importlib

    import click

    from tasks.cli import COMMANDS

    for module in set(COMMANDS.values()):
        found = vars(importlib.import_module(f"tasks.cli.{module}"))
        nested = {id(sub) for obj in found.values() if isinstance(obj, click.Group) for sub in obj.commands.values()}
        top = {name for name, obj in found.items() if isinstance(obj, click.Command) and id(obj) not in nested}
        assert top == {name for name, home in COMMANDS.items() if home == module}, module
    code = ("import sys, click; from tasks.cli import cli; cli.get_command(click.Context(cli), 'status'); "
            "print(sorted(m for m in sys.modules if m.startswith('tasks.cli.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(loaded.stdout.replace("'", '"')) == ["tasks.cli.devices", "tasks.cli.helpers", "tasks.cli.results"]


@pytest.mark.timeout(120)
def test_celery_commands_load_the_app_without_a_fleet(tmp_path):
    """With no fleet and no DEVICEFLEET_REDIS_URL, `celery -A tasks report` works offline and a
    command that needs the broker fails with the one-line NoFleetError, not a traceback."""
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path))
    report = subprocess.run([*CELERY, "report"], env=env, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "software -> celery:" in report.stdout and "Traceback" not in report.stderr

    inspect = subprocess.run([*CELERY, "inspect", "active", "--timeout", "2"], env=env, capture_output=True,
                             text=True, timeout=60)
    output = (inspect.stdout + inspect.stderr).strip()
    assert inspect.returncode != 0
    assert "Traceback" not in output and len(output.splitlines()) == 1, output
    assert "no Redis to connect to" in output and str(tmp_path) in output and "devicefleet up" in output


@pytest.mark.timeout(60)
def test_a_worker_whose_redis_refuses_its_registration_exits_1_for_systemd_to_restart_it(tmp_path):
    # A primary cut off from its replicas refuses writes (min-replicas-to-write): the worker
    # cannot join. Celery's worker_main() made that exit 0, which Restart=on-failure ignores.
    refusing = subprocess.Popen([str(find_redis_server()), "--port", str(port := free_port()), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--min-replicas-to-write", "1"],
                                stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: _answers(url), 10, "the redis-server to answer")
        env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path), DEVICEFLEET_REDIS_URL=url)
        worker = subprocess.run([*CLI, "worker", "cpu5"], env=env, capture_output=True, text=True, timeout=50)
    finally:
        refusing.kill()
        refusing.wait(10)
    assert worker.returncode == 1, worker.stdout[-2000:] + worker.stderr[-2000:]
    assert "NOREPLICAS" in worker.stdout + worker.stderr


def _answers(url: str) -> bool:
    try:
        return bool(connect(url).ping())
    except redis.RedisError:
        return False


@pytest.mark.timeout(120)
def test_up_with_an_unimportable_job_module_exits_2_showing_this_starts_log(tmp_path):
    """A job module that cannot be imported is a configuration error: the worker exits 2 (which
    the systemd unit does not restart) and so does `up`, quoting this start's log lines only."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cpu0.log").write_text("A LINE FROM THE PREVIOUS RUN\n")
    env = cli_env(DEVICEFLEET_STATE_DIR=str(tmp_path), DEVICEFLEET_JOB_MODULES="tasks.jobs,nonexistent_mod")
    up = subprocess.run([*CLI, "up", "--cpu-workers", "1", "--gpus", "0", "--no-flower"], env=env,
                        capture_output=True, text=True, timeout=100)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "worker cpu0 exited with code 2" in up.stderr
    assert "nonexistent_mod" in up.stderr and "cannot be" in up.stderr
    assert "PREVIOUS RUN" not in up.stderr

    # The worker checks its allowlist before it first reaches Redis (nothing listens on port 1).
    env["DEVICEFLEET_REDIS_URL"] = "redis://127.0.0.1:1/0"
    worker = subprocess.run([*CLI, "worker", "cpu5"], env=env, capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2 and "'nonexistent_mod'" in worker.stderr


@pytest.mark.timeout(120)
def test_status_and_run_tables_fit_80_columns_and_never_truncate(fleet):
    """Piped (not a terminal) at 80 columns: every line fits, nothing ends in an ellipsis, and
    the long values wrap instead of being cut."""
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url, COLUMNS="80")
    status = subprocess.run([*CLI, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    run = subprocess.run([*CLI, "run", "probe", "--devices", "cpu0,cpu1", "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for out in (status.stdout, run.stdout):
        table_lines = [line for line in out.splitlines() if "checkpoint:" not in line]
        assert max(len(line) for line in table_lines) <= 80, out
        assert "…" not in out, out
    for header in ("device", "state", "errors", "jobs/s", "samples/s", "cores"):
        assert header in status.stdout, status.stdout
    assert "cpu0: cpu0@" in status.stdout and "CUDA_VISIBLE_DEVICES=-1" in status.stdout
    # Each device's labels (the session fleet's FLEET_LABELS), as a constraint names them.
    words = " ".join(status.stdout.split())  # the lines wrap at 80 columns
    assert 'labels: rack="a"' in words and 'labels: nvlink=true, rack="b"' in words
    # The session fleet allows commands (tests/conftest.py): status names the programs (wrapped).
    assert "commands: " in status.stdout and "bash" in status.stdout.split("commands: ", 1)[1]
    assert "CUDA" in run.stdout and "visible" in run.stdout and run.stdout.count(" ok ") == 2


def test_an_error_written_to_a_pipe_is_one_whole_line(tmp_path):
    """Output to a pipe or a file is not wrapped at 80 columns (issue 51): the error's path
    can be copied and `grep Error:` finds the whole message."""
    state_dir = tmp_path / "a-state-folder-whose-path-is-long-enough-to-cross-the-eightieth-column"
    proc = subprocess.run([*CLI, "status"], env=cli_env(DEVICEFLEET_STATE_DIR=str(state_dir)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3  # no fleet to reach
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and len(errors[0]) > 80, proc.stderr
    assert str(state_dir) in errors[0] and "devicefleet up" in errors[0], proc.stderr


class _Sent:
    """The part of a fan-out's or sweep's handle the wait uses: ``get`` answers only once
    cancelled, and notes the SIGINT handler in place while the cancel is awaited."""

    def __init__(self) -> None:
        self.cancelled = False
        self.dropped = False
        self.handler_while_cancelling: object = None

    def drop_connections(self) -> None:
        self.dropped = True

    def cancel(self) -> None:
        # On fresh connections: the interrupt may have cut one of the wait's commands.
        assert self.dropped, "cancelled on the connections the interrupt may have cut"
        self.cancelled = True

    def get(self, timeout: float) -> dict:
        assert self.cancelled, "the wait did not cancel what was sent"
        self.handler_while_cancelling = signal.getsignal(signal.SIGINT)
        return {"cpu0": {"status": "cancelled"}}


@pytest.mark.timeout(30)
def test_a_ctrl_c_while_jobs_are_sent_cancels_them_once_the_handle_exists(tmp_path):
    """Ctrl-C that lands while `run` or `sweep` is still sending (before its wait's own handler)
    is held, not raised: the wait then cancels what was sent and the command exits 130, where
    before the KeyboardInterrupt escaped (click's "Aborted!", exit 1) and left the jobs running."""
    from tasks.cli import work

    settings = Settings.load(redis_url="redis://:secret@127.0.0.1:1/0", state_dir=tmp_path)
    with work._interrupt_held() as pressed:
        os.kill(os.getpid(), signal.SIGINT)  # while "sending"
        assert pressed.wait(10)
        handle = _Sent()
        results, cancelled = work._wait_or_cancel(handle, "the fan-out", 60, None, settings, pressed)
    assert cancelled and handle.cancelled and results == {"cpu0": {"status": "cancelled"}}
    assert handle.handler_while_cancelling is signal.default_int_handler  # a second Ctrl-C stops at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was


@pytest.mark.timeout(30)
def test_a_ctrl_c_while_the_wait_is_set_up_cancels_the_run_instead_of_aborting(monkeypatch):
    """A Ctrl-C that lands while the wait sets up its watch of the fleet cancels what was sent and
    exits 130 (CI once saw `devicefleet sweep` end as click's "Aborted!", exit 1, its trials left
    running: the handler that raises was installed before the try that cancels); during the
    cancel's own wait a second Ctrl-C stops at once."""
    from contextlib import contextmanager

    from tasks.cli import work
    from tasks.ops import fleet_lost

    @contextmanager
    def watching(settings, what):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, as the watch is being set up
        yield

    monkeypatch.setattr(fleet_lost, "watching_the_fleet", watching)
    handle = _Sent()
    before = signal.getsignal(signal.SIGINT)
    try:
        with work._interrupt_held() as pressed:  # as `devicefleet run` and `sweep` wait
            results, cancelled = work._wait_or_cancel(handle, "the test's run", 5, None, None,  # type: ignore[arg-type]
                                                     pressed)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped the wait: the run was left going and the command aborted")
    assert (results, cancelled) == ({"cpu0": {"status": "cancelled"}}, True)
    assert handle.handler_while_cancelling is signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is before  # each handler put back on the way out
