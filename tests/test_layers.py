"""The package's layers: import-linter's contracts, no import cycle, and a light ``import tasks``.

The contracts live in pyproject.toml ([tool.importlinter]); import-linter checks them statically.
What it cannot see (an import inside a function, a library loaded by a dependency) is checked
here at run time, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: Launcher-side and heavy libraries a producer's ``import tasks`` must not load.
HEAVY = ("prometheus_client", "rich", "torch", "flower", "tornado")


def _lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter's ``lint-imports`` command on ``config``, from the repository root."""
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(config), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=90, env=_env(),
    )


def _env() -> dict[str, str]:
    import os

    # Wide enough that no contract name is wrapped; no colour codes in the output.
    return {**os.environ, "COLUMNS": "500", "NO_COLOR": "1", "TERM": "dumb"}


def test_import_linter_contracts_are_kept():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert contracts, "pyproject.toml declares no import-linter contract"
    proc = _lint_imports(ROOT / "pyproject.toml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"Contracts: {len(contracts)} kept, 0 broken." in out, out
    for contract in contracts:
        assert f"{contract['name']} KEPT" in out, f"{contract['name']!r} not reported kept:\n{out}"


def test_import_linter_reports_a_broken_contract(tmp_path):
    # The harness above must be able to fail: a contract the package breaks is reported broken.
    config = tmp_path / "broken.toml"
    config.write_text(
        '[tool.importlinter]\nroot_package = "tasks"\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "the worker does not use the core (false on purpose)"\n'
        'type = "forbidden"\n'
        'source_modules = ["tasks.worker.lease"]\n'
        'forbidden_modules = ["tasks.core.keys"]\n'
    )
    proc = _lint_imports(config)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "BROKEN" in out and "0 kept, 1 broken" in out, out


# -- import cycles ----------------------------------------------------------------------------------


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The cycles a depth-first search meets in ``graph`` (``{module: modules it imports}``).

    Each cycle is a path that starts and ends at the same module; edges to modules outside the
    graph are ignored. An empty list means the graph is acyclic (every cycle has at least one
    back edge, and the search reports each back edge it follows).
    """
    unseen, on_path, done = 0, 1, 2
    state = {module: unseen for module in graph}
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if state[root] != unseen:
            continue
        # Iterative DFS: (module, iterator over its imports); ``path`` mirrors the stack.
        state[root] = on_path
        path = [root]
        stack = [iter(sorted(graph[root]))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                state[path.pop()] = done
                continue
            if child not in state:
                continue
            if state[child] == on_path:
                cycles.append(path[path.index(child):] + [child])
            elif state[child] == unseen:
                state[child] = on_path
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return cycles


@pytest.mark.parametrize(("graph", "expected"), [
    ({}, []),
    ({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}, []),  # a diamond is no cycle
    ({"a": ["b"], "b": ["c"], "c": ["a"]}, [["a", "b", "c", "a"]]),
    ({"a": ["a"]}, [["a", "a"]]),
    ({"a": [], "m": ["n"], "n": ["m"]}, [["m", "n", "m"]]),  # not reachable from the first module
    ({"a": ["outside", "b"], "b": []}, []),  # an import of a module outside the graph
    ({"a": ["b"], "b": ["c"], "c": ["b", "d"], "d": ["a"]}, [["a", "b", "c", "d", "a"], ["b", "c", "b"]]),
])
def test_the_cycle_finder(graph, expected):
    assert sorted(find_cycles(graph)) == sorted(expected)


def test_no_import_cycle_in_the_package():
    import grimp

    # No cache: a stale one would hide a cycle; every import counts, inside functions too.
    graph = grimp.build_graph("tasks", cache_dir=None)
    modules = {module for module in graph.modules if module == "tasks" or module.startswith("tasks.")}
    assert "tasks.worker.lease" in modules and len(modules) > 20, sorted(modules)
    imports = {module: graph.find_modules_directly_imported_by(module) & modules for module in modules}
    cycles = find_cycles(imports)
    where = [
        f"{' -> '.join(cycle)}: " + "; ".join(
            f"{detail['importer']}:{detail['line_number']} {detail['line_contents']}"
            for importer, imported in zip(cycle, cycle[1:], strict=False)
            for detail in graph.get_import_details(importer=importer, imported=imported)
        )
        for cycle in cycles
    ]
    assert not cycles, "import cycles in tasks:\n" + "\n".join(where)


# -- what `import tasks` loads -----------------------------------------------------------------------


def _fresh_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_tasks_loads_no_heavy_library():
    code = f"import tasks, sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    assert _fresh_python(code) == "[]"


def test_a_job_process_loads_neither_celery_nor_redis_nor_the_settings():
    """Each public name of ``tasks`` loads on first use: a job process (``tasks.jobproc`` and the
    built-in jobs) pays for torch, not for the producer side it never uses."""
    code = ("import sys, tasks.jobproc.main, tasks.jobs\n"
            "print(sorted(m for m in ('celery', 'kombu', 'redis', 'pydantic_settings', 'tasks.producer', "
            "'tasks.core.app', 'tasks.core.settings') if m in sys.modules))")
    assert _fresh_python(code) == "[]"


def test_every_public_name_of_tasks_is_where_it_says():
    import tasks

    assert sorted(tasks.__all__) == sorted(tasks._HOMES)
    # The names mypy and IDEs see (imported under TYPE_CHECKING) come from the same modules.
    tree = ast.parse(Path(tasks.__file__).read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name: "." * node.level + (node.module or "")
             for node in checked.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == tasks._HOMES
    for name in tasks.__all__:
        assert getattr(tasks, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'fan_outt'"):
        tasks.fan_outt  # noqa: B018


def test_import_tasks_loads_neither_the_launcher_nor_the_worker_side():
    code = (
        "import json, sys, tasks\n"
        "loaded = sorted(m for m in sys.modules if m == 'tasks.ops.fleet' or m.startswith(('tasks.ops', 'tasks.worker')))\n"
        "print(json.dumps(loaded))\n"
        "tasks.Fleet  # the launcher, loaded on first use\n"
        "print(json.dumps('tasks.ops.fleet' in sys.modules))\n"
    )
    before, after_fleet = _fresh_python(code).splitlines()
    assert json.loads(before) == []
    assert json.loads(after_fleet) is True, "tasks.Fleet did not load the launcher"
