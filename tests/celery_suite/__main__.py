"""Run Celery's own integration tests on plain Celery and on devicefleet's transport and backend,
and compare.

Celery's integration tests (``t/integration`` of the sdist of the installed Celery: pip
downloads it into a cache; nothing of Celery's is kept in this repository) run with Celery's
own session worker against one throwaway ``redis-server`` on loopback, three times:

- ``plain``: Celery's Redis transport and backend, Celery's prefork worker: the reference;
- ``fleet``: ``broker_transport = tasks.core.transport:Transport`` and the result backend
  ``tasks.core.backend:FleetBackend``, Celery's prefork worker;
- ``fleet-threads``: the same, in a worker built as devicefleet builds its device workers: the
  ``threads`` pool and :class:`tasks.worker.consumer.FleetConsumer`.

A test that passes in ``plain`` must pass in the fleet's runs, except the expected divergences
(:mod:`tests.celery_suite.plugin`, each a deliberate rule with its reason, marked xfail(strict):
they must still diverge). A test that fails in ``plain`` too is reported, not counted. A test
that hangs fails at its timeout. Exit status 1 when the fleet's runs lose a test plain Celery
passes, 0 otherwise.

``python3 -m tests.celery_suite [--runs plain,fleet,fleet-threads] [--all]``: ``--all`` runs
every test of the four files instead of the selection (over half an hour here).
"""

from __future__ import annotations

import argparse
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

from .plugin import FILES, RUNS

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


def run_tests(run: str, root: Path, redis: PlainRedis, report: Path, everything: bool) -> float:
    """One run of the selection (or ``everything``); its JUnit XML in ``report``; its seconds."""
    (root / "integration-tests-config.json").write_text(json.dumps(run_config(run)))
    redis_flush(redis)
    env = {**os.environ, "TEST_BROKER": redis.url, "TEST_BACKEND": redis.url, "REDIS_HOST": "127.0.0.1",
           "REDIS_PORT": str(redis.port), "DEVICEFLEET_CELERY_SUITE_RUN": run,
           "DEVICEFLEET_CELERY_SUITE_ALL": "1" if everything else "",
           "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    env.pop("DEVICEFLEET_REDIS_URL", None)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-p", "celery.contrib.pytest", "-p", "tests.celery_suite.plugin",
                    "-p", "no:cacheprovider",
                    "-q", "-rfE", f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={report}",
                    *(f"t/integration/{name}" for name in FILES)], cwd=root, env=env, check=False)
    return time.monotonic() - started


def redis_flush(redis: PlainRedis) -> None:
    import redis as redis_py

    client = redis_py.Redis(port=redis.port)
    try:
        client.flushall()
    finally:
        client.close()


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
          f"{sum(o == 'xfailed' for o in other.values())} expected divergences, {len(both)} failing on plain "
          "Celery too (compared, not counted)")
    for test in both:
        print(f"  fails on plain Celery too: {test}")
    for test in lost:
        print(f"  LOST: {test}")
    return lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.celery_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    parser.add_argument("--all", action="store_true", help="every test of the files, not the selection")
    parser.add_argument("--keep", type=Path, help="keep the sdist's tests and the reports in this folder")
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if unknown := sorted(set(runs) - set(RUNS)):
        parser.error(f"unknown run(s) {', '.join(unknown)}: choose from {', '.join(RUNS)}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="devicefleet-celery-suite-"))
    try:
        root = celery_tests(celery.__version__, work)
        results: dict[str, dict[str, str]] = {}
        with PlainRedis(work / "redis") as redis:
            for run in ["plain", *(r for r in runs if r != "plain")]:
                report = work / f"{run}.xml"
                seconds = run_tests(run, root, redis, report, args.all)
                results[run] = outcomes(report)
                print(f"celery-suite: {run}: {len(results[run])} tests in {seconds:.0f} s", flush=True)
        lost = [t for run in runs if run != "plain" for t in compare(results["plain"], results[run], run)]
        return 1 if lost else 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
