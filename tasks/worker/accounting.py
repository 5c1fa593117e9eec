"""Counting finished jobs for the fleet's metrics, in the round trip that stores the job's result.

Counters in Redis (``keys.stats(device)``, ``keys.finished(device)``) survive a worker restart
and need no event stream, so they are exact; :mod:`tasks.ops.exporter` reads them on each scrape.
What a job's output adds is what the job declared (``@job(..., metrics=...)``), never a field
name this module knows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..core.defaults import FINISHED_KEEP_S as KEEP_S
from ..core.job import JobMetric

logger = logging.getLogger(__name__)


def job_count(
    device: str,
    worker: str,
    *,
    ok: bool,
    started: float,
    finished: float,
    metrics: Mapping[JobMetric, float] | None = None,
    gpu_memory_bytes: int | None = None,
) -> dict[str, Any]:
    """One finished job's counts, as the result backend's store script adds them
    (:class:`tasks.core.jobstate.JobFinish`): in the same round trip as the job's stored result.

    Args:
        ok: whether the job succeeded (counted as ``jobs_ok``, else ``jobs_error``).
        metrics: the job's declared metrics: counters are added, gauges kept as ``last_<name>``.

    Numbers travel as ``repr`` strings, so Redis stores what Python would have written.
    """
    add = {"busy_seconds": repr(max(0.0, finished - started))}
    latest: dict[str, str] = {"worker": worker, "last_finished_at": repr(finished)}
    for metric, value in (metrics or {}).items():
        if metric.is_counter:
            add[metric.value] = repr(float(value))
        else:
            latest[f"last_{metric.value}"] = repr(value)
    if gpu_memory_bytes is not None:
        latest["gpu_memory_bytes"] = str(gpu_memory_bytes)
    return {
        "device": device, "outcome": "jobs_ok" if ok else "jobs_error", "add": add, "set": latest,
        "finished": repr(finished), "keep_after": repr(finished - KEEP_S),
    }

