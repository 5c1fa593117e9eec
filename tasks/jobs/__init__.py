"""Built-in jobs: ``train`` (a real model on a real dataset) and ``probe`` (what a worker sees).

This package is the default job allowlist (``DEVICEFLEET_JOB_MODULES=tasks.jobs``).
"""

from . import probe, train

__all__ = ["probe", "train"]
