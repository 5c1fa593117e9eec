"""``python -P -m tasks.ops.celery_main ARGS``: Celery's own ``celery ARGS``, with devicefleet's
``tasks`` package imported first.

``celery -A tasks ...`` finds the app with the working directory put first on ``sys.path``
(``celery.app.utils.find_app`` imports through ``celery.utils.imports.import_from_cwd``), so in a
folder holding a ``tasks.py`` of the user's (Celery's tutorial starts with one) it loads that file.
Run as a submodule of ``tasks``, this module has the package imported (from where
:func:`tasks.core.shadow.python_child` puts it) before Celery looks, and Celery's import then
returns it from ``sys.modules``. The launcher starts Flower through it (``-A tasks flower``), and
so does ``devicefleet-flower.service``.

Before Celery runs, the process hides the fleet's secrets its environment holds (the Redis URL,
Flower's login) from the other processes of its user, the fleet's jobs among them
(:func:`tasks.core.hiding.hide_from_children`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery


def run(app: Celery, argv: list[str]) -> int:
    """Run Celery's ``celery ARGV`` command with ``app`` and return its exit status.

    What ``app.start(argv)`` and ``app.worker_main(argv)`` do, less their loss of the status:
    click, run with ``standalone_mode=False`` as they run it, returns the status of a command
    that ends with ``ctx.exit(code)`` (``celery worker`` always does) where they expect an
    exception, so a worker that could not start exited 0 and systemd's ``Restart=on-failure``
    left it down.
    """
    from celery.bin.celery import celery as celery_command

    # Celery internal, as Celery.start() sets it (Celery 5.7.0): the --app option's default.
    celery_command.params[0].default = app
    try:
        status = celery_command.main(args=argv, standalone_mode=False)
    finally:
        celery_command.params[0].default = None
    return status if isinstance(status, int) else 0


def main() -> None:
    from celery.__main__ import main as celery_main

    from ..core.hiding import environment_secrets, hide_from_children

    hide_from_children(environment_secrets())
    sys.argv[0] = "celery"
    celery_main()


if __name__ == "__main__":
    main()
