"""Fixtures: a real redis-server and real device workers, started by the launcher users use.

The session fleet runs two CPU devices (cpu0, cpu1) on its own embedded Redis, in a temporary
state dir, plus one worker per GPU where torch sees one. It allowlists ``tests.fleet_jobs`` next
to the built-in jobs, so tests can make a job fail on purpose (and the docs' ``my_jobs``).
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

# The tests must not pick up a developer's own fleet or settings (the switch that makes CI
# require system tools is the tests' own, not a fleet setting).
for _key in [k for k in os.environ if k.startswith("DEVICEFLEET_") and k != "DEVICEFLEET_REQUIRE_SYSTEM_TOOLS"]:
    del os.environ[_key]
# Nor the terminal's size: the commands the tests run write to pipes, at their natural width,
# unless a test asks for a width. (pytest-xdist sets COLUMNS=80 and LINES=24 in its workers,
# which would make every command the suite runs lay its output out for an 80-column terminal.)
for _key in ("COLUMNS", "LINES"):
    os.environ.pop(_key, None)

from tasks import Fleet, Settings  # noqa: E402
from tasks.core import keys  # noqa: E402
from tasks.core.devices import count_gpus  # noqa: E402
from tasks.core.registry import connect  # noqa: E402
from tasks.ops.flower import auth_header  # noqa: E402
from tasks.ops.redis_server import EmbeddedRedis  # noqa: E402

from . import system_tools  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEST_JOB_MODULES = ["tasks.jobs", "tests.fleet_jobs"]


def test_env() -> dict[str, str]:
    """Environment for processes the tests start: they can import ``tests.fleet_jobs``."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a command the tests run as users do: this one's without its own
    ``DEVICEFLEET_*`` settings, plus :func:`test_env` and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEFLEET_")}
    env.update(test_env())
    env.update(extra)
    return env


@contextmanager
def standalone_worker(fleet: Fleet, device: str, argv: list[str], log_path: Path,
                      **extra: str) -> Iterator[tuple[subprocess.Popen[bytes], Any]]:
    """A worker for ``device`` started with ``argv`` (as a user starts one) on ``fleet``'s Redis,
    on core 0 with the test jobs; yields it and its registry record once it is ready, and
    kills it on the way out if it is still running."""
    from tasks.core.registry import connect, live_workers

    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url, DEVICEFLEET_CORES="0",
                  DEVICEFLEET_JOB_MODULES=",".join(TEST_JOB_MODULES), **extra)
    client = connect(fleet.redis_url)
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            record = wait_for(lambda: (r := live_workers(client).get(device)) is not None and r.ready and r,
                              90, f"{device} to join", proc=proc)
            yield proc, record
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            # A killed worker's record lives out its TTL: the next test of this session's fleet
            # (which counts its cpu devices) must not see it.
            left = live_workers(client).get(device)
            if left is not None and left.pid == proc.pid:
                client.delete(keys.worker(device), keys.job_schemas(device))
            client.close()


def make_settings(state_dir: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "state_dir": state_dir,
        "job_modules": TEST_JOB_MODULES,
        "heartbeat_interval_s": 0.5,
        "heartbeat_ttl_s": 3.0,
    }
    values.update(overrides)
    return Settings.load(**values)


@pytest.fixture(scope="session")
def gpu_count() -> int:
    return count_gpus()


def worker_configs(folder: Path, tables: dict[str, dict[str, object]] | None = None, **values: object) -> Path:
    """The packaged worker configs copied into ``folder`` with ``values`` in place of their own
    (e.g. ``cancel_grace_s=2.0``; a key the files leave unset is added), and ``tables`` added at
    their end (e.g. ``{"commands": {"programs": [...], "workdirs": [...]}}``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in (ROOT / "worker_configs").glob("*.toml"):
        text = source.read_text()
        for key, value in values.items():
            line = re.search(rf"^{key} = .*$", text, flags=re.MULTILINE)
            setting = f"{key} = {json.dumps(value)}"
            if line:
                text = text.replace(line.group(0), setting)
            else:  # before the first table, where a top-level key must go
                table = re.search(r"^\[", text, flags=re.MULTILINE)
                at = table.start() if table else len(text)
                text = f"{text[:at].rstrip()}\n{setting}\n\n{text[at:]}"
        for name, table_values in (tables or {}).items():
            body = "\n".join(f"{key} = {json.dumps(value)}" for key, value in table_values.items())
            text = f"{text.rstrip()}\n\n[{name}]\n{body}\n"
        (folder / source.name).write_text(text)
    return folder


#: Where the session fleet's commands run (tests/scripts) and the programs they may start:
#: torchrun is this Python's own (beside it), as a user's virtualenv has it. This Python under
#: both its names (the docs' examples run ``python3``; the suite may be run as ``python -m pytest``).
SCRIPTS = ROOT / "tests" / "scripts"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PYTHONS = sorted({sys.executable, *(str(p) for name in ("python", "python3")
                                    if (p := Path(sys.executable).with_name(name)).exists())})
FLEET_COMMANDS = {"programs": [*PYTHONS, "bash", TORCHRUN], "workdirs": [str(SCRIPTS)]}


#: The session fleet's job modules: the test jobs, and the job module the docs' "Your own job"
#: page shows (tests/scripts/my_jobs.py and my_data_jobs.py, which tests/test_docs.py checks are the
#: page's files), so
#: that page's examples run on this fleet too.
FLEET_JOB_MODULES = [*TEST_JOB_MODULES, "tests.scripts.my_jobs", "tests.scripts.my_data_jobs"]

#: The session fleet's worker configs: a short grace for jobs asked to stop, and a memory
#: threshold a test's leaking job crosses in two runs (tests/test_isolation.py).
FLEET_CANCEL_GRACE_S = 2.0
FLEET_MEMORY_GROWTH_MIB = 300


#: The session fleet's CPU devices' labels (their own worker configs, cpu0.toml and cpu1.toml):
#: a mixed fleet for placement's tests (tests/test_placement.py).
FLEET_LABELS: dict[str, dict[str, object]] = {"cpu0": {"rack": "a"}, "cpu1": {"rack": "b", "nvlink": True}}


def label_devices(configs: Path, labels: dict[str, dict[str, object]]) -> None:
    """Give each device of ``labels`` its own config: its kind's template with its ``[labels]``."""
    for device, values in labels.items():
        kind = device.rstrip("0123456789")
        body = "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
        (configs / f"{device}.toml").write_text(f"{(configs / f'{kind}.toml').read_text().rstrip()}\n\n[labels]\n{body}\n")


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two CPU devices (and each visible GPU) on an embedded redis-server; the CPU devices carry
    :data:`FLEET_LABELS`."""
    state = tmp_path_factory.mktemp("fleet")
    configs = worker_configs(state / "worker_configs", tables={"commands": FLEET_COMMANDS},
                             cancel_grace_s=FLEET_CANCEL_GRACE_S, max_memory_growth_mib=FLEET_MEMORY_GROWTH_MIB)
    label_devices(configs, FLEET_LABELS)
    settings = make_settings(state, worker_configs_dir=configs, job_modules=FLEET_JOB_MODULES)
    with Fleet(settings, cpu_workers=2, stop_timeout=20, extra_env=test_env()).start() as running:
        yield running


@contextmanager
def supervised_fleet(settings: Settings) -> Iterator[Fleet]:
    """Two CPU workers supervised as ``devicefleet up`` supervises them: a worker that dies is
    started again (for the tests that kill workers)."""
    stop = threading.Event()
    with Fleet(settings, cpu_workers=2, stop_timeout=20, extra_env=test_env()).start() as running:
        supervisor = threading.Thread(target=running.supervise, args=(stop, 0.2), daemon=True)
        supervisor.start()
        try:
            yield running
        finally:
            stop.set()
            supervisor.join(5)


@pytest.fixture(scope="session")
def app(fleet: Fleet):  # type: ignore[no-untyped-def]
    app = fleet.app()
    yield app
    # A result handle unsubscribes from Redis when it is collected: collected now, while the
    # fleet's Redis runs, each does (one collected after it stopped gives up at once since the
    # backend stopped retrying there: tests/test_components.py's let-go test).
    gc.collect()
    app.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """An embedded redis-server of the test module's own (no fleet): for components run in-process."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("module-redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(redis_server: EmbeddedRedis):  # type: ignore[no-untyped-def]
    """A client of the module's embedded Redis, whose database is empty at the start of each test."""
    redis_client = connect(redis_server.url)
    redis_client.flushdb()
    yield redis_client
    redis_client.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that skipped for a missing system tool must be marked so (``tools`` or ``system``):
    CI's fresh-machine check skips it, and only the marked run with the tools present runs it."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (report.skipped and call.excinfo is not None and getattr(call.excinfo.value, system_tools.TOOL_MISSING, False)
            and not any(item.get_closest_marker(name) for name in system_tools.MARKERS)):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} skipped ({call.excinfo.value.msg}) but is marked none of "
                           f"{', '.join(system_tools.MARKERS)}: mark it `tools` (pytest.mark.tools), so that "
                           ".ci/run runs it where the tool is")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the GPU-marked tests where torch sees no GPU, except a module's own dry run on a
    CPU device (its ``DRY_RUN``: tests/test_gpu_issues.py with GPU_CHECK_DEVICE=cpu0)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")
                 and not getattr(getattr(item, "module", None), "DRY_RUN", False)]
    if gpu_items and count_gpus() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def unchecked_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer sees no published params schemas, as with workers from before they were
    published: bad kwargs reach the worker, whose own validation these tests are about."""
    import tasks.producer.fanout

    monkeypatch.setattr(tasks.producer.fanout, "job_schemas", lambda client, runs: {})


def queue_length(client: Any, queue: str) -> int:
    """Every message waiting in ``queue`` at the normal level: its own list and each user's list
    beside it (fair share: a job that names its user waits in ``device.cpu0~alice``)."""
    from tasks.core.priority import Level
    from tasks.core.queue_lists import QueueLists

    return QueueLists.read(client, queue).count(client, Level.NORMAL, steps=False)


T = TypeVar("T")


def producer_connections(url: str) -> int:
    """The connections to the fleet at ``url`` that producers' default clients opened
    (``CLIENT LIST`` by their name)."""
    from tasks.producer.connections import CLIENT_NAME

    with connect(url) as admin:
        return sum(1 for client in admin.client_list() if client.get("name") == CLIENT_NAME)


def wait_for(check: Callable[[], T], timeout: float, what: str, poll: float = 0.05,
             proc: subprocess.Popen[Any] | None = None) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value,
    or at once if ``proc`` (the process that should make it true) exits first."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last value {last!r}")
        time.sleep(poll)


def http_status(url: str, auth: str | None = None) -> int:
    headers = {"Authorization": auth_header(auth)} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def read_markers(path: Path) -> list[dict[str, Any]]:
    """The start/end lines ``sleepy`` runs (tests/reliability_jobs.py) wrote to ``path``; none
    yet: an empty list."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


__all__ = ["ROOT", "cli_env", "http_status", "read_markers", "make_settings", "standalone_worker", "test_env", "sys",
           "wait_for", "worker_configs"]
