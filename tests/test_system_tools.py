"""A missing system tool skips locally with a reason naming its package, and fails under CI."""

from __future__ import annotations

import sys

import pytest

from . import system_tools


def test_missing_tool_skips_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(system_tools.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"no-such-tool-xyz is missing: apt-get install xyz-pkg"):
        system_tools.tool("no-such-tool-xyz", "xyz-pkg")


def test_missing_tool_fails_when_ci_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(system_tools.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"/nonexistent/chromium is missing: apt-get install chromium"):
        system_tools.tool("/nonexistent/chromium", "chromium")


def test_present_tool_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(system_tools.REQUIRE_ENV, "1")
    assert system_tools.tool(sys.executable, "python3") == sys.executable


def test_not_root_skips_saying_what_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(system_tools.REQUIRE_ENV, raising=False)
    monkeypatch.setattr(system_tools.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match=r"not root \(uid 1000\): the rig needs root"):
        system_tools.root("the rig")


def test_not_root_fails_when_ci_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(system_tools.REQUIRE_ENV, "1")
    monkeypatch.setattr(system_tools.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match=r"the rig needs root \(DEVICEFLEET_REQUIRE_SYSTEM_TOOLS=1"):
        system_tools.root("the rig")


def test_a_skip_is_reported_at_the_test_that_skipped_not_at_the_helper(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`-ra` names the test that skipped (issue 51), as for a skipif mark, not tests/system_tools.py."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "test_inner.py").write_text(
        "from tests import system_tools\n\n\ndef test_needs_a_tool():\n"
        "    system_tools.tool('no-such-tool-xyz', 'xyz-pkg')\n")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(system_tools.REQUIRE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", "-c", os.devnull,
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "test_inner.py:4" in skipped[0] and "system_tools" not in skipped[0], proc.stdout


def test_a_test_that_skips_for_a_missing_tool_must_be_marked_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """CI's fresh-machine check skips such a test and only `-m tools` (or `-m system`) runs it
    where the tool is: unmarked, it would run nowhere on CI, so the suite fails it."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "test_inner.py").write_text(
        "import pytest\n\nfrom tests import system_tools\n\n\n"
        "def test_unmarked():\n    system_tools.tool('no-such-tool-xyz', 'xyz-pkg')\n\n\n"
        "@pytest.mark.tools\ndef test_marked():\n    system_tools.tool('no-such-tool-xyz', 'xyz-pkg')\n")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(system_tools.REQUIRE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-c", os.devnull, "--rootdir", str(tmp_path), "-W", "ignore::pytest.PytestUnknownMarkWarning",
                           str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 skipped" in proc.stdout, proc.stdout
    assert "test_unmarked skipped (no-such-tool-xyz is missing: apt-get install xyz-pkg) but is marked none of " \
           "tools, system: mark it `tools`" in proc.stdout, proc.stdout
