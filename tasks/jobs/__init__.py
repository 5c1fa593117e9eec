"""Built-in jobs: ``train`` (a real model on a real dataset), ``probe`` (what a worker sees) and
``noop`` (nothing: the fleet's own cost per job).

This package is the default job allowlist (``DEVICEFLEET_JOB_MODULES=tasks.jobs``).
"""

from . import noop, probe, train

__all__ = ["noop", "probe", "train"]
