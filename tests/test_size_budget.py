"""A size budget for the core and the worker side (an AST scan, beside tests/test_defaults.py's):
no module of tasks/core/ or tasks/worker/ over MODULE_LINES lines, no class over CLASS_LINES
(``end_lineno - lineno + 1``), unless it is named below with its reason. An exception that no
longer needs to be one fails too, so the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parent.parent / "tasks"
#: The wings under the budget: every module below them, subpackages too.
WINGS = ("core", "worker")
MODULE_LINES = 600
CLASS_LINES = 300

#: ``path`` (a module) or ``path::Class`` (a class), relative to the repository, and why it is over.
EXCEPTIONS: dict[str, str] = {}


def over_budget(package: Path = PACKAGE) -> dict[str, int]:
    """Each module and class of ``package``'s wings over its budget, by ``path`` or
    ``path::Class``: its lines."""
    found: dict[str, int] = {}
    for wing in WINGS:
        for path in sorted((package / wing).rglob("*.py")):
            text = path.read_text()
            where = str(path.relative_to(package.parent))
            if len(text.splitlines()) > MODULE_LINES:
                found[where] = len(text.splitlines())
            for node in ast.walk(ast.parse(text, where)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    if lines > CLASS_LINES:
                        found[f"{where}::{node.name}"] = lines
    return found


def test_no_module_or_class_of_the_core_or_the_worker_is_over_its_budget_unless_named_with_its_reason():
    found = over_budget()
    unnamed = {where: lines for where, lines in found.items() if where not in EXCEPTIONS}
    assert not unnamed, (f"over the budget ({MODULE_LINES} lines a module, {CLASS_LINES} a class): {unnamed}; "
                         "split it, or name it in EXCEPTIONS with its reason")
    stale = sorted(set(EXCEPTIONS) - set(found))
    assert not stale, f"within the budget now: take {stale} out of EXCEPTIONS"
    assert all(reason.strip() for reason in EXCEPTIONS.values())


def test_the_scan_sees_a_module_and_a_class_over_the_budget_in_a_subpackage(tmp_path):
    wing = tmp_path / "tasks" / "core" / "deep"
    wing.mkdir(parents=True)
    body = "\n".join(f"    x{n} = {n}" for n in range(CLASS_LINES))
    (wing / "big.py").write_text("class Big:\n" + body + "\n" + "\n" * (MODULE_LINES - CLASS_LINES))
    (wing / "small.py").write_text("class Small:\n" + body[: body.index("\n")] + "\n")
    assert over_budget(tmp_path / "tasks") == {"tasks/core/deep/big.py": MODULE_LINES + 1,
                             "tasks/core/deep/big.py::Big": CLASS_LINES + 1}
