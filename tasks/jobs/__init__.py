"""Built-in jobs: ``train`` (a real model on a real dataset), ``hogwild`` (one model trained by
several processes in shared memory), ``probe`` (what a worker sees) and ``noop`` (nothing: the
fleet's own cost per job).

This package is the default job allowlist (``DEVICEFLEET_JOB_MODULES=tasks.jobs``).
"""

from . import hogwild, noop, probe, train

__all__ = ["hogwild", "noop", "probe", "train"]
