"""Commands as jobs: an existing program (``python train.py --lr 0.1``) run on a device.

A command is the built-in job :data:`COMMAND_JOB`, whose kwargs are :class:`CommandParams`:
the argv, a working directory, extra environment variables, and any other field, which is a
parameter filled into ``{name}`` placeholders of the argv (a sweep's trial, an Optuna trial).

A message can never make a worker run a program its configuration does not name. A worker runs
commands only when its worker config has a ``[commands]`` table (:class:`CommandPolicy`) naming
the programs it may start and the folders commands may run in; the worker resolves the programs
when it starts and publishes the rules in its registry record (:class:`CommandRules`), so a
producer refuses a command before sending it (:func:`check_command`), and the job process
checks it again before it starts anything (:func:`resolve_command`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator, model_validator

from .errors import CommandRefused, ConfigError, InvalidJobArguments
from .validation import describe_validation_error

#: The built-in job that runs a command (the Celery task ``devicefleet.command``).
COMMAND_JOB = "command"

#: Variables the fleet sets for a command, which a producer's ``env`` may not change: the device
#: a command sees, its rank in a distributed job, and the fleet's own.
FLEET_VARIABLES = frozenset({
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
})
#: Prefixes of variables a producer's ``env`` may not set: the fleet's, torchrun's agent's, and
#: the dynamic loader's (``LD_PRELOAD`` would load any library into an allowed program).
FLEET_PREFIXES = ("DEVICEFLEET_", "TORCHELASTIC_", "LD_")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Variables that make an allowed program load code from elsewhere (a library, a module path, a
#: startup file): a producer's ``env`` may not set them, nor any ``LD_*``.
CODE_LOADING_VARIABLES = frozenset({
    "BASH_ENV", "ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PERL5LIB", "PERL5OPT",
    "NODE_OPTIONS", "NODE_PATH", "RUBYOPT", "RUBYLIB", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS",
})
#: ``{name}`` (a parameter) or ``{{name}}`` (a literal ``{name}``); a ``$`` before it is the
#: shell's, not a placeholder.
PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")


class CommandParams(BaseModel):
    """The kwargs of the command job. Fields other than these are the command's parameters:
    ``{"argv": ["python", "train.py", "--lr", "{lr}"], "lr": 0.1}`` runs ``--lr 0.1``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    #: The program and its arguments; ``{name}`` is replaced by the parameter ``name``
    #: (``{{name}}`` is a literal ``{name}``; other braces are left as they are).
    argv: list[str] = Field(min_length=1)
    #: Working directory: absolute, or relative to the worker's first allowed folder
    #: (default: that folder).
    cwd: str | None = None
    #: Variables added to the command's environment.
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("argv")
    @classmethod
    def _program_named(cls, argv: list[str]) -> list[str]:
        if not argv[0].strip():
            raise ValueError("argv[0] is empty: name the program to run")
        return argv

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _NAME.match(name):
                raise ValueError(f"env name {name!r} is not a variable name")
            if name.startswith("LD_") or name in CODE_LOADING_VARIABLES:
                raise ValueError(f"env {name} cannot be given: it would make an allowed program load "
                                 "code from elsewhere (run Python scripts from their folder, or with -m)")
            if name in FLEET_VARIABLES or name.startswith(FLEET_PREFIXES):
                raise ValueError(f"env {name} is set by the fleet for every command and cannot be given")
        return env

    @model_validator(mode="after")
    def _params_are_json(self) -> CommandParams:
        for name, value in (self.model_extra or {}).items():
            if not _NAME.match(name):
                raise ValueError(f"parameter {name!r} is not a name a placeholder can use")
            if isinstance(value, (dict, list)):
                raise ValueError(f"parameter {name}={value!r} is not a number, string or bool")
        return self

    @property
    def params(self) -> dict[str, JsonValue]:
        """The parameters (the fields besides argv, cwd and env)."""
        return dict(self.model_extra or {})

    def placeholders(self) -> list[str]:
        """The parameter names the argv's placeholders use, in order."""
        return [m.group(2) for arg in self.argv for m in PLACEHOLDER.finditer(arg) if m.group(2)]

    def formatted_argv(self) -> list[str]:
        """The argv with every ``{name}`` replaced by its parameter (``{{name}}`` stays ``{name}``;
        other braces are left alone: ``${HOME}``, JSON, awk's ``{print $1}``).

        Raises:
            InvalidJobArguments: a placeholder names no parameter.
        """
        params = self.params
        missing = [name for name in self.placeholders() if name not in params]
        if missing:
            raise InvalidJobArguments(
                f"command argument {{{missing[0]}}} names no parameter of the command (it has "
                f"{', '.join(sorted(params)) or 'none'}): give {missing[0]!r} in the sweep's trials, the "
                f"study's space or the kwargs, or write {{{{{missing[0]}}}}} for a literal {{{missing[0]}}}")

        def fill(match: re.Match[str]) -> str:
            escaped, name = match.group(1), match.group(2)
            return "{" + escaped + "}" if escaped else _as_argument(params[name])

        return [PLACEHOLDER.sub(fill, arg) for arg in self.argv]


def command_params(kwargs: Any) -> CommandParams:
    """A producer's kwargs of the command job, checked.

    Raises:
        ConfigError: they do not fit; the message names each bad field.
    """
    try:
        return CommandParams.model_validate(kwargs)
    except ValidationError as exc:
        raise ConfigError(f"command: {describe_validation_error(exc)}") from None


def _as_argument(value: Any) -> str:
    """A parameter as an argument: JSON's spelling for bools and None (``true``), else str."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


class CommandPolicy(BaseModel):
    """A worker config's ``[commands]`` table: what commands its device may run. Empty: none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Programs a command may start: absolute paths, or names looked up on the worker's PATH
    #: when it starts. An interpreter (``python``, ``bash``) runs whatever script it is given.
    programs: list[str] = Field(default_factory=list)
    #: Folders (absolute, or ``~/...``: below the worker's home, for ``devicefleet up``) a command
    #: may run in, with everything below them; the first is the default working directory.
    workdirs: list[str] = Field(default_factory=list)

    @field_validator("programs")
    @classmethod
    def _programs(cls, programs: list[str]) -> list[str]:
        for program in programs:
            if not program.strip() or ("/" in program and not os.path.isabs(program)):
                raise ValueError(f"commands.programs: {program!r} is not a program name or an absolute path")
        return programs

    @field_validator("workdirs")
    @classmethod
    def _workdirs(cls, workdirs: list[str]) -> list[str]:
        for folder in workdirs:
            if not (os.path.isabs(folder) or folder == "~" or folder.startswith("~/")):
                raise ValueError(f"commands.workdirs: {folder!r} is not an absolute path (nor ~/...)")
        return workdirs

    def home_workdirs(self) -> list[str]:
        """The workdirs given as ``~/...``: the worker's home is where it runs, not where its
        config was written (under systemd, the service's: ``devicefleet deploy`` refuses them)."""
        return [folder for folder in self.workdirs if folder.startswith("~")]

    @model_validator(mode="after")
    def _both(self) -> CommandPolicy:
        if self.programs and not self.workdirs:
            raise ValueError("commands.programs is set but commands.workdirs is empty: name the folders "
                             "commands may run in")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.programs)

    def rules(self, path: str | None = None, config: str | None = None) -> CommandRules:
        """The policy with each program resolved on ``path`` (default: this process's PATH);
        a program that is not found is left out (``missing``), a workdir that is not a folder
        here is kept and named in ``missing_workdirs``. ``config``: the file it was read from."""
        programs: dict[str, str] = {}
        missing: list[str] = []
        for program in self.programs:
            found = shutil.which(program, path=path if path is not None else os.environ.get("PATH"))
            if found is None:
                missing.append(program)
            else:
                programs[program] = os.path.abspath(found)
        workdirs = [os.path.realpath(os.path.expanduser(d)) for d in self.workdirs]
        return CommandRules(programs=programs, workdirs=workdirs, missing=missing,
                            missing_workdirs=[d for d in workdirs if not os.path.isdir(d)], config=config)


class CommandRules(BaseModel):
    """A worker's command policy as resolved when it started (its registry record carries it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: ``{program as configured: the path it was found at}`` (run as found, not as its symlink's
    #: target: a virtualenv's ``bin/python`` finds its packages by its own path).
    programs: dict[str, str]
    workdirs: list[str]
    #: Configured programs that were not found.
    missing: list[str] = Field(default_factory=list)
    #: Workdirs (resolved) that were not folders when the worker started.
    missing_workdirs: list[str] = Field(default_factory=list)
    #: The worker config file the rules came from (None: not known, an older worker).
    config: str | None = None

    def allowed_text(self) -> str:
        return ", ".join(self.programs) or "none"

    def where(self, device: str) -> str:
        """The file to edit to change these rules, as a message names it."""
        return f"{self.config} [commands]" if self.config else f"{config_hint(device)} [commands]"

    def problems(self, device: str) -> list[str]:
        """What in the rules cannot work on the worker's host, each naming the key and the fix
        (the worker logs them when it starts; the producer refuses a command they concern)."""
        found = [f"commands.programs {program!r} is not found on {device}'s PATH: install it, or give its "
                 f"absolute path in {self.where(device)}" for program in self.missing]
        found += [_missing_workdir(folder, device, self) for folder in self.missing_workdirs]
        return found

    def named(self, program: str) -> str | None:
        """The allowed program the bare name ``program`` names: as configured, or by its file's
        name (``python3`` for ``/usr/bin/python3``); None if none. The producer and the worker
        both go by this, so they agree."""
        if program in self.programs:
            return self.programs[program]
        return next((p for p in self.programs.values() if os.path.basename(p) == program), None)

    def allows(self, path: str) -> bool:
        """Whether the file at ``path`` is one of the allowed programs (symlinks followed)."""
        target = os.path.realpath(path)
        return any(target == os.path.realpath(p) for p in self.programs.values())

    def working_directory(self, cwd: str | None, device: str) -> Path:
        """The folder a command with ``cwd`` runs in.

        Raises:
            CommandRefused: it is outside every allowed folder.
        """
        if not self.workdirs:
            raise CommandRefused(f"{device} allows no working directory (commands.workdirs is empty)")
        base = self.workdirs[0]
        folder = os.path.realpath(os.path.join(base, cwd) if cwd else base)
        if not any(folder == d or folder.startswith(d.rstrip("/") + "/") for d in self.workdirs):
            raise CommandRefused(
                f"working directory {cwd!r} ({folder}) is outside the folders {device}'s worker config "
                f"allows (commands.workdirs: {', '.join(self.workdirs)}; {self.where(device)})")
        return Path(folder)

    def existing_directory(self, cwd: str | None, device: str) -> Path:
        """:meth:`working_directory`, which must be a folder on this host.

        Raises:
            CommandRefused: it is not allowed, or it does not exist (the message names the
                workdir key and the fix).
        """
        folder = self.working_directory(cwd, device)
        if not folder.is_dir():
            raise CommandRefused(_missing_workdir(str(folder), device, self))
        return folder


def config_hint(device: str) -> str:
    """The worker config files of ``device`` (``cpu0``: ``worker_configs/cpu0.toml`` or ``cpu.toml``)."""
    kind = re.sub(r"\d+$", "", device.rsplit("@", 1)[0])
    return f"worker_configs/{kind}.toml (or its own {device}.toml; under systemd in /etc/devicefleet/)"


def _missing_workdir(folder: str, device: str, rules: CommandRules) -> str:
    if folder in rules.missing_workdirs or not rules.workdirs or folder == rules.workdirs[0]:
        return (f"commands.workdirs folder {folder} does not exist on {device}'s host: create it "
                f"(mkdir -p {folder}) and put your scripts there, or name a folder you have in "
                f"{rules.where(device)}, then restart the worker")
    return f"working directory {folder} does not exist on {device}'s host: create it, or give another --cwd"


def _refused_program(program: str, device: str, rules: CommandRules) -> CommandRefused:
    return CommandRefused(
        f"program {program!r} is not allowed on {device}: its worker config's commands.programs allows "
        f"{rules.allowed_text()}; add it there ({rules.where(device)}) and restart the worker to run it")


def _no_commands(device: str) -> CommandRefused:
    return CommandRefused(f"{device} runs no commands: its worker config has no [commands] programs; "
                          f"uncomment [commands] in {config_hint(device)} and restart the worker")


def _missing_program(program: str, device: str, rules: CommandRules) -> CommandRefused | None:
    """The refusal of a bare ``program`` that is configured but was not found when the worker started."""
    if program in rules.missing and rules.named(program) is None:
        return CommandRefused(f"commands.programs {program!r} was not found on {device}'s PATH when its worker "
                              f"started: install it, or give its absolute path in {rules.where(device)}, "
                              "then restart the worker")
    return None


def check_command(params: CommandParams, device: str, rules: CommandRules | None) -> None:
    """The producer's check of a command against a device's published rules (the worker checks
    again with :func:`resolve_command`).

    Raises:
        CommandRefused: the device runs no commands, or not this program or folder.
        InvalidJobArguments: a placeholder names no parameter.
    """
    if rules is None or not (rules.programs or rules.missing):
        raise _no_commands(device)
    params.formatted_argv()
    program = params.argv[0]
    known = rules.allows(program) if os.path.isabs(program) else rules.named(program) is not None
    if not known:
        raise _missing_program(program, device, rules) or _refused_program(program, device, rules)
    folder = str(rules.working_directory(params.cwd, device))
    gone = next((d for d in rules.missing_workdirs if folder == d or folder.startswith(d.rstrip("/") + "/")), None)
    if gone is not None:
        raise CommandRefused(_missing_workdir(gone, device, rules))


def resolve_command(params: CommandParams, device: str, rules: CommandRules | None) -> tuple[list[str], Path]:
    """The argv to execute (its program resolved to an allowed file, its placeholders filled)
    and the working directory, as the worker's rules allow them. A bare name runs the allowed
    program it names (the configured path, not another of that name on PATH: a virtualenv's
    ``python`` stays the virtualenv's).

    Raises:
        CommandRefused: the program or the folder is not allowed.
        InvalidJobArguments: a placeholder names no parameter.
    """
    if rules is None or not rules.programs:
        raise _no_commands(device)
    argv = params.formatted_argv()
    program = argv[0]
    if os.path.isabs(program):
        found: str | None = program if rules.allows(program) else None
    elif "/" in program:  # ./train.sh names no configured program
        found = None
    else:
        found = rules.named(program)
    if found is None or not os.path.exists(found):
        raise _missing_program(program, device, rules) or _refused_program(program, device, rules)
    return [found, *argv[1:]], rules.existing_directory(params.cwd, device)
