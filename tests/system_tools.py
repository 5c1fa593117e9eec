"""System tools the tests drive for real (Chromium, Debian's redis-server, systemd-analyze).

On a developer's machine a missing tool skips the tests that need it, with a reason that names
the Debian package to install. CI must not skip them silently: ``.ci/run`` installs the packages
and sets ``DEVICEFLEET_REQUIRE_SYSTEM_TOOLS=1``, which turns each such skip into a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

#: Set to 1 by ``.ci/run``: a missing system tool fails the test instead of skipping it.
REQUIRE_ENV = "DEVICEFLEET_REQUIRE_SYSTEM_TOOLS"
#: The markers of the tests that may skip for a missing tool (``tools``: in the plain run;
#: ``system``: a rig's own step). ``.ci/run``'s fresh-machine check skips such a test, and only
#: its run of ``-m tools`` (``-m system``) with the tools present runs it: an unmarked test that
#: skipped so would run nowhere on CI, so the suite fails it (tests/conftest.py).
MARKERS = ("tools", "system")

#: Set on the skip of a test whose system tool (or root) this machine lacks (an attribute, not a
#: subclass: pytest would print a subclass's name in the skip's reason).
TOOL_MISSING = "devicefleet_tool_missing"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing(what: str, package: str) -> None:
    """Skip (locally) or fail (under ``.ci/run``) because ``what`` is not on this machine."""
    unavailable(f"{what} is missing: apt-get install {package}")


def root(why: str) -> None:
    """Skip (locally) or fail (under ``.ci/run``) unless this process runs as root, which
    ``why`` needs (e.g. network namespaces)."""
    if os.geteuid() != 0:
        unavailable(f"not root (uid {os.geteuid()}): {why} needs root")


def unavailable(reason: str) -> None:
    """Skip (locally) or fail (under ``.ci/run``) for ``reason``: what this machine lacks."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: CI must run this test)", pytrace=False)
    # Reported at the test that skipped, not at this line (as pytest reports a skipif mark or a
    # fixture's skip): `-ra` then names the test.
    skip = pytest.skip.Exception(reason, _use_item_location=True)
    setattr(skip, TOOL_MISSING, True)
    raise skip


def tool(name: str, package: str) -> str:
    """The path of system tool ``name`` (a command on PATH, or an absolute path); skips or fails
    when it is absent."""
    found = name if Path(name).is_absolute() and Path(name).exists() else shutil.which(name)
    if found is None:
        missing(name, package)
    assert found is not None
    return found
