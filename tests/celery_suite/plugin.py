"""The pytest plugin that runs Celery's integration tests for :mod:`tests.celery_suite`.

Loaded with ``-p tests.celery_suite.plugin`` in the rootdir of Celery's extracted ``t/``. In the
fleet's runs (``DEVICEFLEET_CELERY_SUITE_RUN``) Celery's ``redis`` result backend alias names
the fleet's backend (the tests read the ``redis://`` scheme of the URL, so the URL stays), and
``fleet-threads`` starts Celery's session worker with the ``threads`` pool, as devicefleet
starts its device workers (the transport and the consumer come from the run's
``integration-tests-config.json``).

The selection: the tests that exercise what devicefleet overrides (chords, chains, groups,
errbacks, revokes, result states, the backend's pub/sub and store); :data:`LEFT_OUT` says what
is not run by default and why (``DEVICEFLEET_CELERY_SUITE_ALL=1`` runs everything).
:data:`EXPECTED` lists the expected divergences of the fleet's runs, each a deliberate rule with
its reason; they are marked ``xfail(strict=True)``, so one that starts passing fails the run
and the list is kept honest.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

#: Celery's integration test files run (``test_backend.py`` is Azure-only).
FILES = ("test_canvas.py", "test_tasks.py", "test_redis_backend.py", "test_group_chains.py")
#: The runs, in the order they run: ``plain`` first, the reference.
RUNS = ("plain", "fleet", "fleet-threads")
#: The files of a run, where not all of them (and why).
RUN_FILES: dict[str, tuple[tuple[str, ...], str]] = {
    "fleet-threads": (
        ("test_canvas.py", "test_redis_backend.py", "test_group_chains.py"),
        "test_tasks.py checks what a pool does to a task's own code (time limits, revoke with "
        "terminate, a task blocked on another): a thread can be neither ended nor time-limited, so "
        "with the session worker's one thread blocked the rest of the file waits out its timeouts. "
        "devicefleet's worker never runs a task's code on its threads (its jobs run in job "
        "processes, which it does end); what the threads run checks is the consumer, the "
        "transport and the backend under the fleet's pool, which the other three files exercise"),
}

#: Substrings of test ids not run by default, and why (``--all`` runs them: see the README's
#: Development section for the last full run's outcome).
LEFT_OUT: dict[str, str] = {
    "allow_error_cb_on_chord_header": (
        "three tests that each wait out the chord join's own timeouts: 135 to 284 s apiece, 590 s of "
        "a 1,100 s run (and test_disabling_flag_... fails on plain Celery here). What they check, the "
        "errbacks of a chord whose header failed and its body not run, is what "
        "test_nested_chord_header_link_error and the 20 test_*errback_called_by_chord_from_* tests "
        "check, and those run; in the last full run all three behaved on the fleet as on plain Celery"),
    "test_chord::test_generator": (
        "a chord's header built from a generator, 1 to 9 items (60 s): the producer's canvas building, "
        "which devicefleet does not change"),
    "test_revoked_by_headers_complex_canvas": "fails on plain Celery here too (22 s)",
}

#: Per run, substrings of test ids that are expected to fail there, and why. The fleet's
#: transport and backend have none: every test that passes on plain Celery passes on them.
EXPECTED: dict[str, dict[str, str]] = {
    "fleet": {},
    "fleet-threads": {
        "test_chord_soft_timeout_recuperation": (
            "a task's soft_time_limit: Celery's threads pool has no time limits (a thread cannot be "
            "interrupted), so the task runs on and the chord sums 103, not 3; the fleet's worker "
            "enforces its jobs' time limits on their job processes instead"),
    },
}


def _run() -> str:
    return os.environ.get("DEVICEFLEET_CELERY_SUITE_RUN", "plain")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flaky: Celery's rerun marker (pytest-rerunfailures is not installed)")
    if _run() != "plain":
        from celery.app import backends

        from tasks.core.app import BACKEND

        backends.BACKEND_ALIASES["redis"] = BACKEND
    if _run() == "fleet-threads":
        from celery.contrib.testing import worker

        original = worker.start_worker

        def start_worker(app: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["pool"] = "threads"
            return original(app, *args, **kwargs)

        worker.start_worker = start_worker


@pytest.fixture(scope="session", autouse=True)
def fleet_parts_in_use(request: pytest.FixtureRequest) -> None:
    """A fleet run that silently ran on Celery's own parts would prove nothing: check them."""
    if _run() == "plain":
        return
    from tasks.core.app import TRANSPORT
    from tasks.core.backend import FleetBackend

    app = request.getfixturevalue("celery_session_app")
    assert isinstance(app.backend, FleetBackend), type(app.backend)
    assert app.conf.broker_transport == TRANSPORT, app.conf.broker_transport


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    everything = bool(os.environ.get("DEVICEFLEET_CELERY_SUITE_ALL"))
    kept, dropped = [], []
    for item in items:
        if not everything and any(part in item.nodeid for part in LEFT_OUT):
            dropped.append(item)
            continue
        kept.append(item)
        for part, reason in EXPECTED.get(_run(), {}).items():
            if part in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=f"devicefleet: {reason}", strict=True))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
