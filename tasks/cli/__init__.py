"""The ``devicefleet`` command.

Settings precedence: command-line options, then ``DEVICEFLEET_*`` variables, then defaults.
This is the only package that configures logging handlers (:func:`~tasks.cli.helpers.setup_logging`).

Errors: a devicefleet error that ends a command is one line on stderr, ``Error: ...`` (click's
prefix, which its own usage errors print). Exit statuses (one rule, :func:`tasks.core.errors.exit_status`):
2 (:data:`~tasks.core.errors.EXIT_CONFIG`) refused before anything was sent (a bad value on the command line or in
the kwargs, an unknown job or device, a group that cannot form, a command not allowed; click's
usage errors too); 1 (:data:`~tasks.core.errors.EXIT_FAILED`) a job failed (or the command failed otherwise); 3
(``EXIT_FLEET_LOST``) the fleet went away under a waiting producer, or there is none to reach.

One module per command group (:data:`COMMANDS`), as rq splits ``rq/cli/``, each imported only
when one of its commands runs (or a help lists them: :class:`~tasks.cli.helpers.Commands`); what
they share is in :mod:`~tasks.cli.helpers` and, for the commands that send work,
:mod:`~tasks.cli.results`.
"""

from __future__ import annotations

import click

from .helpers import Commands, setup_logging

__all__ = ["cli", "main"]

#: Each command (or group of commands) of ``devicefleet``: the module of this package that defines
#: it, under the same name.
COMMANDS = {
    "up": "fleet", "demo": "fleet", "bench": "fleet", "exporter": "fleet", "tensorboard": "fleet",
    "worker": "worker", "deploy": "deploy",
    "run": "work", "sweep": "work", "optimize": "work",
    "status": "devices", "device": "devices",
    "user": "users", "cap": "users", "usage": "users",
}


@click.group(cls=Commands, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="devicefleet")
def cli(verbose: int) -> None:
    """Run one machine-learning job per device (each CPU worker, each GPU) at once."""
    setup_logging(verbose)


def main() -> None:
    """The ``devicefleet`` console script (and ``python -m tasks``)."""
    cli(standalone_mode=True)
