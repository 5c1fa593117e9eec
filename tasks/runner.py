"""The Celery tasks behind a fan-out: ``run_job`` on each device, ``collect`` at the end.

``run_job`` never raises for a job's failure: it returns an entry with ``status="error"``, so
the chord always completes and one device's failure never hides another's result.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

logger = logging.getLogger(__name__)

RUN_JOB = "devicefleet.run_job"
COLLECT = "devicefleet.collect"


@shared_task(name=RUN_JOB, bind=True, Strategy="tasks.transport:guarded_strategy")
def run_job(self: Any, device: str, job: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` with ``kwargs`` on this worker's device; returns the device's entry."""
    from .worker import current_worker

    return current_worker().execute(self, device, job, kwargs)


@shared_task(name=COLLECT)
def collect(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Fold the chord's entries into ``{device: entry}``."""
    return {entry["device"]: entry for entry in entries}
