"""The jobs a device worker runs: the ones its job processes loaded from the allowlist.

The worker never imports a job module itself (they import torch, and whatever else a job's
author wrote at module level): its first job process does (:mod:`tasks.jobproc.registry`) and
names them in its hello; the jobs step registers each as the Celery task ``devicefleet.<name>``.
"""

from __future__ import annotations

import json

from ..core.errors import UnknownJob
from ..core.job import unknown_job
from ..core.wire import JobInfo


class JobCatalog:
    """The jobs of a worker's allowlist ``modules``, as its job process found them."""

    def __init__(self, jobs: list[JobInfo], modules: list[str]) -> None:
        self._jobs = {info.name: info for info in jobs}
        self.modules = list(modules)

    @property
    def names(self) -> list[str]:
        return sorted(self._jobs)

    @property
    def packable(self) -> dict[str, list[str]]:
        """``{job: its pack key params}`` of the jobs that pack (the registry's ``packable``)."""
        return {name: list(info.pack) for name, info in sorted(self._jobs.items()) if info.pack is not None}

    def infos(self) -> list[JobInfo]:
        return [self._jobs[name] for name in self.names]

    def schemas(self) -> dict[str, str]:
        """``{job: JSON schema of its params}`` of the jobs that have one, as the worker publishes them."""
        return {info.name: json.dumps(info.params_schema) for info in self.infos() if info.params_schema is not None}

    def unknown(self, name: str) -> UnknownJob:
        """The error for a job ``name`` that is not one of these (a message naming another task)."""
        return unknown_job(name, self.names, self.modules)
