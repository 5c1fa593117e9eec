"""What every command of ``devicefleet`` shares: its consoles, its one-line errors, its settings,
and the group that loads each command from its module (:class:`Commands`)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from ..core.defaults import PIPED_OUTPUT_WIDTH
from ..core.errors import EXIT_CONFIG, EXIT_FAILED, DeviceFleetError, exit_status
from ..core.settings import Settings
from ..core.users import denial


def _console(stderr: bool = False) -> Console:
    """A console for stdout (or stderr): rich's layout at the terminal's width on a terminal; on
    a pipe or a file, every line whole (soft wrap, and tables at their natural width up to
    :data:`~tasks.core.defaults.PIPED_OUTPUT_WIDTH`), so a path or an error line in a log can be
    copied and grepped (rich would otherwise wrap at 80 columns), unless ``COLUMNS`` asks for a
    width: then rich's layout at that width, as on a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    if (stream is not None and stream.isatty()) or os.environ.get("COLUMNS"):  # a width asked for: rich's layout
        return Console(stderr=stderr)
    return Console(stderr=stderr, soft_wrap=True, width=PIPED_OUTPUT_WIDTH)


console = _console()
err_console = _console(stderr=True)


#: Before each error line: click's own, so that every error of the command reads the same.
ERROR_PREFIX = "Error:"


def fail(exc: BaseException, code: int = EXIT_FAILED) -> NoReturn:
    err_console.print(f"[bold red]{ERROR_PREFIX}[/] {escape(str(exc))}", highlight=False, markup=True)
    raise SystemExit(code)


def load_settings(**overrides: Any) -> Settings:
    try:
        return Settings.load(**overrides)
    except DeviceFleetError as exc:
        fail(exc, EXIT_CONFIG)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class Commands(click.Group):
    """The ``devicefleet`` group: each command (or group of them) is imported from the module of
    :mod:`tasks.cli` that ``lazy`` names for it, only when it runs or a help lists it; a
    devicefleet error that ends one of its commands is one line (:func:`fail`), with the exit
    status :mod:`tasks.cli` lists."""

    def __init__(self, *args: Any, lazy: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.lazy:
            return None
        command = getattr(importlib.import_module(f"{__package__}.{self.lazy[cmd_name]}"), cmd_name)
        assert isinstance(command, click.Command), f"{self.lazy[cmd_name]}.{cmd_name} is not a command"
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DeviceFleetError as exc:
            fail(exc, exit_status(exc))
        except Exception as exc:  # Redis refused a user's credentials or command: one line
            refused = denial(exc, _credentials_user())
            if refused is None:
                raise
            fail(refused, exit_status(refused))


def _credentials_user() -> str | None:
    """The user of the credentials this command runs with, if any (for an error's message)."""
    try:
        credentials = Settings.load().user_credentials
    except DeviceFleetError:
        return None
    return credentials.user if credentials is not None else None
