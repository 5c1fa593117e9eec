"""What the commands that send work share: the producer app, the live progress, the result
table and the exit status."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import click

from ..core.app import create_app
from ..core.errors import EXIT_FAILED, EXIT_INTERRUPTED
from ..core.records import Entry
from ..core.settings import Settings
from ..ops.progress_view import watch
from ..ops.result_table import fanout_table
from .helpers import console, err_console


def producer_app(settings: Settings) -> Any:
    """The command's producer app, closed with its connections when the command ends (click's
    context closes on every exit: a result, an error, ``SystemExit``), not left to the garbage
    collector: the CLI also runs in process (``CliRunner``, a script calling ``cli.main``)."""
    app = create_app(settings.model_copy(update={"redis_url": settings.resolve_redis_url()}))
    click.get_current_context().call_on_close(app.close)
    return app


def exit_code(entries: Iterable[Mapping[str, Any]], cancelled: bool) -> int:
    """130 after Ctrl-C, 1 if a job failed, else 0."""
    if cancelled:
        return EXIT_INTERRUPTED
    return 0 if all(Entry.parse(entry).ok for entry in entries) else EXIT_FAILED


def watch_progress(handle: Any, timeout: float) -> None:
    """Live progress bars on stderr while ``handle`` runs (only on a terminal)."""
    if err_console.is_terminal:
        watch(handle, err_console, timeout=timeout)


def print_results(results: dict[str, dict[str, Any]], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    table, below = fanout_table(results)
    console.print(table)
    for line in below:
        console.print(line, highlight=False, soft_wrap=True)
