"""Run Celery's own integration tests on plain Celery and on devicefleet's transport and backend,
and compare.

Celery's integration tests (``t/integration`` of the sdist of the installed Celery: pip
downloads it into a cache; nothing of Celery's is kept in this repository) run with Celery's
own session worker, each run in shards (:func:`shards`), each shard against a throwaway
``redis-server`` of its own on loopback, all at the same time (the tests mostly wait on results
and timeouts, not on a core):

- ``plain``: Celery's Redis transport and backend, Celery's prefork worker: the reference;
- ``fleet``: ``broker_transport = tasks.core.transport:Transport`` and the result backend
  ``tasks.core.backend:FleetBackend``, Celery's prefork worker;
- ``fleet-threads``: the same, in a worker built as devicefleet builds its device workers: the
  ``threads`` pool and :class:`tasks.worker.consumer.FleetConsumer`.

A test that passes in ``plain`` must pass in the fleet's runs, except the expected divergences
(:mod:`tests.celery_suite.plugin`, each a deliberate rule with its reason, marked xfail(strict):
they must still diverge). A test a fleet run loses is run again alone in that run and in
``plain``; it counts as lost if it fails again and passes in ``plain`` (else it is reported as
flaky). A test that fails in ``plain`` too is reported, not counted. A test that hangs fails at
its timeout. Exit status 1 when a fleet run loses a test, 0 otherwise.

``python3 -m tests.celery_suite [--runs plain,fleet,fleet-threads] [--all] [--keep DIR]``:
``--all`` runs every test of the four files instead of the selection (about 20 minutes here).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import celery

from tasks.core.app import CONSUMER, TRANSPORT
from tasks.ops.proc import free_port, wait_until
from tasks.ops.redis_server import find_redis_server

from .plugin import FILES, RUN_FILES, RUNS

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DEVICEFLEET_CELERY_SDIST_CACHE", Path.home() / ".cache" / "devicefleet"))
#: Seconds one test may take before it fails (Celery's own tests use up to 300; theirs that
#: wait out a timeout of their own take 10-30 s).
TEST_TIMEOUT_S = 120


def celery_tests(version: str, into: Path) -> Path:
    """Celery ``version``'s ``t/`` folder, from its sdist (downloaded once into :data:`CACHE`),
    extracted under ``into``; returns the folder that holds ``t/`` (the tests' rootdir)."""
    sdist = CACHE / f"celery-{version}.tar.gz"
    if not sdist.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"celery=={version}", "-d", str(CACHE)], check=True)
    root = into / f"celery-{version}"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(f"celery-{version}/t/")]
        archive.extractall(into, members=members, filter="data")
    # A pytest rootdir of its own, with the settings of Celery's pyproject.toml that its tests
    # rely on (test classes named test_*, strict xfails), not the rest (its markers need
    # plugins the fleet's tests do not install), nor this repository's.
    (root / "pytest.ini").write_text("[pytest]\npython_classes = test_*\nxfail_strict = true\n")
    return root


class PlainRedis:
    """A throwaway redis-server on loopback without a password: Celery's tests connect with
    ``REDIS_HOST``/``REDIS_PORT`` and no credentials."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PlainRedis:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [str(find_redis_server()), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        wait_until(lambda: _pings(client), 15, "the integration tests' redis-server")
        client.close()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _pings(client: object) -> bool:
    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001  (not up yet)
        return False


def run_config(run: str) -> dict[str, object]:
    """Celery settings of one run, over the integration tests' own (``integration-tests-config.json``).
    The result backend stays ``redis://`` (the tests check the URL's scheme): the plugin
    resolves Celery's ``redis`` alias to the fleet's backend for the fleet's runs."""
    if run == "plain":
        return {}
    config: dict[str, object] = {"broker_transport": TRANSPORT}
    if run == "fleet-threads":
        config["worker_consumer"] = CONSUMER
    return config


def pytest_command(run: str, root: Path, redis: PlainRedis, report: Path, tests: list[str],
                   everything: bool) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one run of ``tests`` (node ids or files)."""
    (root / "integration-tests-config.json").write_text(json.dumps(run_config(run)))
    env = {**os.environ, "TEST_BROKER": redis.url, "TEST_BACKEND": redis.url, "REDIS_HOST": "127.0.0.1",
           "REDIS_PORT": str(redis.port), "DEVICEFLEET_CELERY_SUITE_RUN": run,
           "DEVICEFLEET_CELERY_SUITE_ALL": "1" if everything else "",
           "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    env.pop("DEVICEFLEET_REDIS_URL", None)
    argv = [sys.executable, "-m", "pytest", "-p", "celery.contrib.pytest", "-p", "tests.celery_suite.plugin",
            "-p", "no:cacheprovider", "-q", "-rfE", f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={report}", *tests]
    return argv, env


#: Each run's tests in shards run at the same time, each with a redis-server and a session worker
#: of its own: Celery's chord tests (about 430 s of a 950 s run, summed over its tests), its
#: chain and group tests (about 250 s), and the rest. The tests wait on results and timeouts
#: (one shard used about a quarter of a core), so the nine shards of the three runs at once take
#: far less than the three runs whole: 356 s here, against 456 s in two shards (chords and
#: chains, then the rest) and 852-860 s whole.
SHARDS = (("t/integration/test_canvas.py::test_chord",),
          ("t/integration/test_canvas.py::test_chain", "t/integration/test_canvas.py::test_group"))


def shards(files: tuple[str, ...]) -> list[list[str]]:
    """The pytest arguments of each shard of a run of ``files``: :data:`SHARDS`, then the rest."""
    paths = [f"t/integration/{name}" for name in files]
    if "test_canvas.py" not in files:
        return [paths]
    taken = [test for shard in SHARDS for test in shard]
    return [*(list(shard) for shard in SHARDS), [*paths, *(f"--deselect={test}" for test in taken)]]


def run_all(runs: list[str], work: Path, src: Path, everything: bool) -> dict[str, dict[str, str]]:
    """Every run at once, each in its own copy of the tests, in shards (:func:`shards`) with a
    redis-server each (the tests spend most of their time waiting on results and timeouts, not
    on a core); their outcomes. A test one of the fleet's runs loses is run again alone, in that
    run and in ``plain``, and counts as lost only if it fails again there and passes in ``plain``."""
    with contextlib.ExitStack() as stack:
        started, procs, roots = time.monotonic(), {}, {}
        for run in runs:
            root = roots[run] = work / run
            shutil.copytree(src, root)
            for i, tests in enumerate(shards(RUN_FILES.get(run, (FILES, ""))[0])):
                name = f"{run}.{i}"
                redis = stack.enter_context(PlainRedis(work / f"redis-{name}"))
                argv, env = pytest_command(run, root, redis, work / f"{name}.xml", tests, everything)
                log = stack.enter_context((work / f"{name}.log").open("w"))
                procs[name] = (subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT),
                               run, redis)
        for name, (proc, _, _) in procs.items():
            proc.wait()
            print(f"celery-suite: {name}: done after {time.monotonic() - started:.0f} s; its log: {work / f'{name}.log'}")
            print((work / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1], flush=True)
        results: dict[str, dict[str, str]] = {run: {} for run in runs}
        for name, (_, run, _) in procs.items():
            results[run].update(outcomes(work / f"{name}.xml"))
        redis_of = {run: redis for _, run, redis in procs.values()}
        for run in runs:
            if run == "plain":
                continue
            for test in [t for t, o in results[run].items() if o == "failed" and results["plain"].get(t) == "passed"]:
                again = {}
                for which in (run, "plain"):
                    argv, env = pytest_command(which, roots[which], redis_of[which], work / "again.xml",
                                               [node_id(test)], everything)
                    subprocess.run(argv, cwd=roots[which], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT, check=False)
                    again[which] = outcomes(work / "again.xml").get(test, "failed")
                if again[run] == "passed" or again["plain"] != "passed":
                    print(f"celery-suite: {run}: {test} failed once, then {again[run]} ({again['plain']} on plain): "
                          "a flaky test, not counted")
                    results[run][test] = "flaky"
    return results


def node_id(test: str) -> str:
    """``t.integration.test_canvas.test_chord::test_x`` (a JUnit class name and test) as a pytest
    node id, ``t/integration/test_canvas.py::test_chord::test_x``."""
    classname, name = test.split("::", 1)
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if f"{parts[i - 1]}.py" in FILES:
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return test


def outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed|failed|skipped|xfailed|xpassed}`` from a JUnit XML report."""
    results: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if "failure" in kinds or "error" in kinds:
            results[test] = "failed"
        elif skipped is not None:
            results[test] = "xfailed" if (skipped.get("type") or "").endswith("xfail") else "skipped"
        else:
            results[test] = "passed"
    return results


def compare(reference: dict[str, str], other: dict[str, str], run: str) -> list[str]:
    """The tests ``run`` loses: passed in ``plain``, failed (not an expected divergence) here."""
    lost = sorted(t for t, outcome in other.items() if outcome == "failed" and reference.get(t) == "passed")
    both = sorted(t for t, outcome in other.items() if outcome == "failed" and reference.get(t) == "failed")
    print(f"\n{run}: {sum(o == 'passed' for o in other.values())} passed, {len(lost)} lost against plain, "
          f"{sum(o == 'xfailed' for o in other.values())} xfailed (Celery's own xfail marks and the expected "
          f"divergences), {len(both)} failing on plain Celery too (compared, not counted)")
    for test in both:
        print(f"  fails on plain Celery too: {test}")
    for test in lost:
        print(f"  LOST: {test}")
    return lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.celery_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)} (plain always runs)")
    parser.add_argument("--all", action="store_true", help="every test of the files, not the selection")
    parser.add_argument("--keep", type=Path, help="keep the tests, logs and reports in this (new) folder")
    args = parser.parse_args(argv)
    runs = ["plain", *(r for r in args.runs.split(",") if r and r != "plain")]
    if unknown := sorted(set(runs) - set(RUNS)):
        parser.error(f"unknown run(s) {', '.join(unknown)}: choose from {', '.join(RUNS)}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="devicefleet-celery-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = celery_tests(celery.__version__, work / "src")
        results = run_all(runs, work, src, args.all)
        lost = [t for run in runs[1:] for t in compare(results["plain"], results[run], run)]
        return 1 if lost else 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
