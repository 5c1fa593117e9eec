"""What systemd would run for a unit: its command line and environment, parsed as systemd does.

A small model of systemd's rules, for tests on machines where systemd is not PID 1:

- unit files and drop-ins (``<unit>.d/*.conf`` of the instance and of the template, in name
  order, later assignments after earlier ones; an empty assignment resets a list);
- ``#``/``;`` comments and backslash line continuations;
- specifiers ``%i %I %n %N %p %%``;
- ``Environment=`` (quoted words), then ``EnvironmentFile=`` (overriding it): ``KEY=value``
  lines, comments, single and double quotes, backslash escapes and continuations;
- ``ExecStart=`` split into words, ``$VAR`` / ``${VAR}`` expanded from that environment.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

#: What systemd (as PID 1, for a system service) puts in every service's environment.
SYSTEMD_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if pending and stripped and stripped[0] in "#;":
            continue  # comment lines inside a continuation are skipped
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending.rstrip())
    return lines


def parse_unit_text(text: str) -> dict[str, list[tuple[str, str]]]:
    """``{section: [(key, value), ...]}`` of one unit file, in order."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in _logical_lines(text):
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        if current is None or "=" not in line:
            raise ValueError(f"not a unit file line: {line!r}")
        key, value = line.split("=", 1)
        sections[current].append((key.strip(), value.strip()))
    return sections


def unit_files(unit_dir: Path, unit: str) -> list[Path]:
    """The file of ``unit`` (its template's for an instance) and its drop-ins, in load order."""
    name, _, suffix = unit.rpartition(".")
    template = re.sub(r"@[^@]*$", "@", name) + "." + suffix if "@" in name else None
    main = unit_dir / unit
    if not main.is_file() and template is not None:
        main = unit_dir / template
    files = [main]
    dropins: dict[str, Path] = {}
    for base in [template, unit] if template else [unit]:
        directory = unit_dir / f"{base}.d"
        if directory.is_dir():
            for conf in directory.glob("*.conf"):
                dropins[conf.name] = conf  # the instance's drop-in replaces the template's
    return files + [dropins[key] for key in sorted(dropins)]


def load_unit(unit_dir: Path, unit: str) -> dict[str, list[str]]:
    """``{"Section.Key": [values]}`` of ``unit`` with its drop-ins, empty assignments resetting."""
    merged: dict[str, list[str]] = {}
    for path in unit_files(unit_dir, unit):
        for section, pairs in parse_unit_text(path.read_text()).items():
            for key, value in pairs:
                slot = merged.setdefault(f"{section}.{key}", [])
                if value == "":
                    slot.clear()
                else:
                    slot.append(value)
    return merged


def specifiers(text: str, unit: str) -> str:
    """Expand ``%i %I %n %N %p %%`` as systemd does for ``unit``."""
    name = unit.rpartition(".")[0]
    prefix, _, instance = name.partition("@")
    table = {"i": instance, "I": instance, "n": unit, "N": name, "p": prefix, "%": "%"}

    def one(match: re.Match[str]) -> str:
        if match[1] not in table:
            raise ValueError(f"specifier %{match[1]} not modelled here")
        return table[match[1]]

    return re.sub(r"%(.)", one, text)


_DQ_ESCAPES = {'"': '"', "\\": "\\", "$": "$", "`": "`", "\n": ""}


def parse_env_file(text: str) -> dict[str, str]:
    """Parse an ``EnvironmentFile=`` as systemd's env-file parser does."""
    env: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        # skip blank space and comment lines
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i < n and text[i] in "#;":
            while i < n and text[i] != "\n":
                i += 1
            continue
        if i >= n:
            break
        start = i
        while i < n and text[i] not in "=\n":
            i += 1
        key = text[start:i].strip()
        if i >= n or text[i] != "=":
            raise ValueError(f"env file line without '=': {key!r}")
        i += 1
        while i < n and text[i] in " \t":
            i += 1
        value: list[str] = []
        trailing_ws = 0
        while i < n and text[i] != "\n":
            ch = text[i]
            if ch == "'":
                end = text.index("'", i + 1)
                value.append(text[i + 1:end])
                i, trailing_ws = end + 1, 0
            elif ch == '"':
                i += 1
                while text[i] != '"':
                    if text[i] == "\\" and text[i + 1] in _DQ_ESCAPES:
                        value.append(_DQ_ESCAPES[text[i + 1]])
                        i += 2
                    else:
                        value.append(text[i])
                        i += 1
                i, trailing_ws = i + 1, 0
            elif ch == "\\" and i + 1 < n:
                if text[i + 1] != "\n":  # backslash-newline: the value goes on
                    value.append(text[i + 1])
                i, trailing_ws = i + 2, 0
            else:
                value.append(ch)
                trailing_ws = trailing_ws + 1 if ch in " \t" else 0
                i += 1
        joined = "".join(value)
        env[key] = joined[: len(joined) - trailing_ws] if trailing_ws else joined
    return env


def _expand(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), word)


def service_exec(unit_dir: Path, unit: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment systemd would start ``unit``'s ``ExecStart=`` with.

    Raises:
        ValueError: a construct this model does not cover.
    """
    conf = load_unit(unit_dir, unit)
    env = dict(SYSTEMD_BASE_ENV)
    for line in conf.get("Service.Environment", []):
        for word in shlex.split(specifiers(line, unit)):
            key, _, value = word.partition("=")
            env[key] = value
    for line in conf.get("Service.EnvironmentFile", []):
        path = specifiers(line, unit)
        optional = path.startswith("-")
        file = Path(path.lstrip("-"))
        if not file.is_file():
            if optional:
                continue
            raise FileNotFoundError(f"{unit}: EnvironmentFile {file} is missing")
        env.update(parse_env_file(file.read_text()))
    exec_lines = conf.get("Service.ExecStart", [])
    if len(exec_lines) != 1:
        raise ValueError(f"{unit}: expected one ExecStart=, got {exec_lines}")
    command = specifiers(exec_lines[0], unit)
    if command[:1] in "-@:+!":
        raise ValueError(f"{unit}: ExecStart prefixes are not modelled: {command!r}")
    argv = [_expand(word, env) for word in shlex.split(command)]
    return argv, env


def exposure_level(analysis: str) -> float:
    """The overall exposure level ``systemd-analyze security UNIT`` printed (0 best, 10 worst)."""
    return float(analysis.rsplit("Overall exposure level for", 1)[1].split(":")[1].split()[0])
