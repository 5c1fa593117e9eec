"""A module named ``tasks`` that is not devicefleet's: Celery's tutorial starts with a ``tasks.py``.

devicefleet's package is named ``tasks``. Python puts the folder it starts in (``python -m``,
``python -c``, the REPL) or the script's folder first on ``sys.path``, so in a folder that holds a
``tasks.py`` or a ``tasks/`` package, ``import tasks``, ``python -m tasks`` and ``celery -A tasks``
get that one instead. The Python processes devicefleet starts never do (:func:`python_child`):
they run with ``-P`` (no working directory on ``sys.path``) and with the folder that holds this
package first on ``PYTHONPATH``; the user's own ``PYTHONPATH`` and folder come after it, so job
modules there still import. A user's process that imported devicefleet in such a folder (a
producer script run from it, any ``devicefleet`` command) says so in one line
(:func:`warn_if_shadowed`).
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

#: This package's folder, and the folder that holds it (site-packages, or a checkout).
PACKAGE = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = PACKAGE.parent


def shadowing_module(folder: str | Path) -> Path | None:
    """The ``tasks`` module or package in ``folder`` that Python would import from there, when it
    is not this package; None when there is none. A ``tasks/`` folder without ``__init__.py`` is
    only a namespace package, which never wins over an installed regular package: not counted."""
    spec = importlib.machinery.PathFinder.find_spec("tasks", [str(folder)])
    if spec is None or spec.origin is None or not spec.has_location:
        return None
    origin = Path(spec.origin)
    if origin.resolve().is_relative_to(PACKAGE):
        return None
    return origin.parent if spec.submodule_search_locations is not None else origin


def notice(found: Path, folder: str | Path) -> str:
    """The one line that says ``found`` shadows devicefleet for Python started in ``folder``."""
    return (f"devicefleet: {found} shadows devicefleet's `tasks` package for Python started in {folder} "
            "(`import tasks`, `python -m tasks`, `celery -A tasks`); the fleet's own processes skip it, "
            "but to use devicefleet from there, rename it (e.g. to celery_app.py) or start from another folder")


def warn_if_shadowed() -> str | None:
    """Log :func:`notice` (a warning: one line on stderr where logging is not set up) when the
    working directory holds a shadowing ``tasks``; returns the line, or None.

    Skipped with ``-P`` (``sys.flags.safe_path``): such a process never looks in its working
    directory, and every Python process devicefleet starts runs so, in the user's folder."""
    if sys.flags.safe_path:
        return None
    try:
        folder = os.getcwd()
        found = shadowing_module(folder)
    except OSError:  # a working directory that was removed, or cannot be read
        return None
    if found is None:
        return None
    line = notice(found, folder)
    logger.warning("%s", line)
    return line


#: The interpreter flags of every Python child: -P, no working directory on sys.path.
CHILD_FLAGS = ("-P",)


def child_pythonpath(env: Mapping[str, str]) -> str:
    """``PYTHONPATH`` for a child: this package's folder first, then the entries of ``env``'s own
    (a folder there may hold a ``tasks`` of its own, and PYTHONPATH comes before site-packages)."""
    entries = [str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(entries))


def python_child(module: str, *args: str, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``python -m module args`` on this interpreter, importing
    devicefleet's own ``tasks`` whatever the working directory or ``PYTHONPATH`` holds; ``env``
    (default: this process's) with its ``PYTHONPATH`` from :func:`child_pythonpath`."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = child_pythonpath(child_env)
    return [sys.executable, *CHILD_FLAGS, "-m", module, *args], child_env
