"""``python -P -m tasks.ops.celery_main ARGS``: Celery's own ``celery ARGS``, with devicefleet's
``tasks`` package imported first.

``celery -A tasks ...`` finds the app with the working directory put first on ``sys.path``
(``celery.app.utils.find_app`` imports through ``celery.utils.imports.import_from_cwd``), so in a
folder holding a ``tasks.py`` of the user's (Celery's tutorial starts with one) it loads that file.
Run as a submodule of ``tasks``, this module has the package imported (from where
:func:`tasks.core.shadow.python_child` puts it) before Celery looks, and Celery's import then
returns it from ``sys.modules``. The launcher starts Flower through it (``-A tasks flower``).
"""

from __future__ import annotations

import sys


def main() -> None:
    from celery.__main__ import main as celery_main

    sys.argv[0] = "celery"
    celery_main()


if __name__ == "__main__":
    main()
