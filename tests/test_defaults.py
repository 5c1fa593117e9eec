"""Every tunable lives in tasks/core/defaults.py (an AST scan of the package), and the settings
objects take their defaults from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tasks.core import defaults
from tasks.core.records import DistributedOptions, JobOptions
from tasks.core.settings import Settings
from tasks.core.wire import ProcessSpec
from tasks.core.worker_config import WorkerConfig
from tasks.worker.supervisor import ProcessPolicy

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(defaults.__file__).resolve().parent.parent  # tasks/
#: The bench's own parameters (its workloads, its step timeouts) and the examples (user code)
#: are not the system's tunables.
OUTSIDE = {PACKAGE / "bench", PACKAGE / "examples"}
#: A name that says "a duration, a period, a retry count" (constants; parameters and fields).
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*_(S|MS|SECONDS|RETRIES)$")
PARAMETER = re.compile(r"(_s|_ms|timeout|interval|poll)$")


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py")
                  if path != Path(defaults.__file__).resolve() and not any(root in path.parents for root in OUTSIDE))


def _number(node: ast.AST | None) -> bool:
    """A numeric literal (``-1``, ``(0.5, 10.0)`` too); 0 is "none", not a tunable."""
    if isinstance(node, ast.UnaryOp):
        return _number(node.operand)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_number(elt) for elt in node.elts)
    return (isinstance(node, ast.Constant) and isinstance(node.value, int | float)
            and not isinstance(node.value, bool) and node.value != 0)


def _offences(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Each tunable ``path`` spells as a number, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    where = str(path.relative_to(root))
    found = []
    scopes = [tree, *(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]
    for scope in scopes:  # module and class level constants, and dataclass/pydantic fields
        for stmt in scope.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
            value = getattr(stmt, "value", None)
            for target in targets:
                names = list(target.elts) if isinstance(target, ast.Tuple) else [target]
                for name in names:
                    if not isinstance(name, ast.Name):
                        continue
                    if CONSTANT.match(name.id) and _number(value):
                        found.append(f"{where}:{stmt.lineno}: {name.id} = {ast.unparse(value)}")  # type: ignore[arg-type]
                    elif scope is not tree and PARAMETER.search(name.id) and _default(value) is not None:
                        found.append(f"{where}:{stmt.lineno}: field {name.id} defaults to {_default(value)}")
    for node in ast.walk(tree):  # parameters' defaults
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True),
                     *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            for arg, default in pairs:
                if PARAMETER.search(arg.arg) and _number(default):
                    found.append(f"{where}:{node.lineno}: {node.name}({arg.arg}={ast.unparse(default)})")  # type: ignore[arg-type]
    return found


def _default(value: ast.AST | None) -> str | None:
    """The literal default of a field: ``= 5.0`` or ``= Field(default=5.0, ...)``."""
    if _number(value):
        return ast.unparse(value)  # type: ignore[arg-type]
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
        for keyword in value.keywords:
            if keyword.arg == "default" and _number(keyword.value):
                return ast.unparse(keyword.value)
    return None


def test_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan itself: each form of a scattered tunable is reported, the allowed forms are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "POLL_S = 0.05\nBACKOFF_S = (0.5, 10.0)\nTTL_MS = 3_000\nNONE_S = 0\nFROM_DEFAULTS_S = defaults.X\n"
        "class C:\n    INTERVAL_S = 0.25\n    grace_s: float = 5.0\n    limit_s: float = Field(default=2.0, gt=0)\n"
        "    off_s: float = 0.0\n    size: int = 3\n"
        "def f(timeout: float = 10.0, *, poll_s: float = 0.5, after_s: float = 0.0, lines: int = 8): ...\n")
    assert [line.split(": ", 1)[1] for line in _offences(sample, tmp_path)] == [
        "POLL_S = 0.05", "BACKOFF_S = (0.5, 10.0)", "TTL_MS = 3000",
        "INTERVAL_S = 0.25", "field grace_s defaults to 5.0", "field limit_s defaults to 2.0",
        "f(timeout=10.0)", "f(poll_s=0.5)"]


def test_every_tunable_is_in_defaults() -> None:
    """No module but tasks/core/defaults.py spells a timing constant, a duration field's default
    or a timeout parameter's default as a number: a new one goes into defaults.py, with its reason."""
    offences = [line for path in _modules() for line in _offences(path)]
    assert offences == [], "tunables outside tasks/core/defaults.py:\n" + "\n".join(offences)


def test_settings_take_their_defaults_from_defaults() -> None:
    settings = Settings.model_fields
    assert (settings["heartbeat_interval_s"].default, settings["heartbeat_ttl_s"].default,
            settings["lease_ttl_s"].default, settings["reaper_interval_s"].default,
            settings["redis_wait_timeout_ms"].default, settings["result_expires_s"].default) == (
        defaults.HEARTBEAT_INTERVAL_S, defaults.HEARTBEAT_TTL_S, defaults.LEASE_TTL_S,
        defaults.REAPER_INTERVAL_S, defaults.REDIS_WAIT_TIMEOUT_MS, defaults.RESULT_EXPIRES_S)
    config = WorkerConfig.model_fields
    assert (config["loader_cores"].default, config["max_job_seconds"].default, config["cancel_grace_s"].default,
            config["max_memory_growth_mib"].default) == (
        defaults.LOADER_CORES, defaults.MAX_JOB_SECONDS, defaults.CANCEL_GRACE_S, defaults.MAX_MEMORY_GROWTH_MIB)
    # The one cancel grace: the worker config's, the wire's and the supervisor's policy.
    assert (ProcessSpec.model_fields["cancel_grace_s"].default, ProcessPolicy().cancel_grace_s) == (
        defaults.CANCEL_GRACE_S, defaults.CANCEL_GRACE_S)
    assert (DistributedOptions().join_timeout_s, DistributedOptions().collective_timeout_s,
            DistributedOptions().max_restarts, JobOptions().max_attempts) == (
        defaults.GANG_JOIN_TIMEOUT_S, defaults.GANG_COLLECTIVE_TIMEOUT_S, defaults.GANG_MAX_RESTARTS,
        defaults.MAX_ATTEMPTS)


def test_every_default_is_documented() -> None:
    """Each tunable in defaults.py has its reason in a ``#:`` comment right above it (or shares
    the comment of the group it is in)."""
    lines = Path(defaults.__file__).read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        if re.match(r"^[A-Z][A-Z0-9_]* = ", line):
            above = index - 1
            while above >= 0 and re.match(r"^[A-Z][A-Z0-9_]* = ", lines[above]):
                above -= 1
            if above < 0 or not lines[above].startswith("#:"):
                undocumented.append(line)
    assert undocumented == []
