"""Counting finished jobs for the fleet's metrics: one pipelined round trip per job.

Counters in Redis (``keys.stats(device)``, ``keys.finished(device)``) survive a worker restart
and need no event stream, so they are exact; :mod:`tasks.ops.exporter` reads them on each scrape.
What a job's output adds is what the job declared (``@job(..., metrics=...)``), never a field
name this module knows.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

import redis

from ..core import keys
from ..core.job import JobMetric

logger = logging.getLogger(__name__)

#: Finish times older than this are dropped from ``keys.finished(device)`` (jobs/s is counted
#: over the last minute: tasks.ops.exporter.RATE_WINDOW_S).
KEEP_S = 600.0


def record_job(
    client: redis.Redis,
    device: str,
    worker: str,
    *,
    job_id: str,
    ok: bool,
    started: float,
    finished: float,
    metrics: Mapping[JobMetric, float] | None = None,
    gpu_memory_bytes: int | None = None,
) -> None:
    """Add one finished job to ``device``'s counters in Redis (one round trip).

    Args:
        ok: whether the job succeeded (counted as ``jobs_ok``, else ``jobs_error``).
        metrics: the job's declared metrics: counters are added, gauges kept as ``last_<name>``.
    """
    key = keys.stats(device)
    pipe = client.pipeline(transaction=True)
    pipe.sadd(keys.STATS_DEVICES, device)
    pipe.hincrby(key, "jobs_ok" if ok else "jobs_error", 1)
    pipe.hincrbyfloat(key, "busy_seconds", max(0.0, finished - started))
    latest: dict[str, str | float | int] = {"worker": worker, "last_finished_at": finished}
    for metric, value in (metrics or {}).items():
        if metric.is_counter:
            pipe.hincrbyfloat(key, metric.value, value)
        else:
            latest[f"last_{metric.value}"] = value
    if gpu_memory_bytes is not None:
        latest["gpu_memory_bytes"] = gpu_memory_bytes
    pipe.hset(key, mapping=latest)  # type: ignore[arg-type]
    pipe.zadd(keys.finished(device), {job_id: finished})
    pipe.zremrangebyscore(keys.finished(device), "-inf", finished - KEEP_S)
    pipe.execute()


def gpu_memory_in_use() -> int | None:
    """Bytes the CUDA caching allocator holds on this process's GPU, or None without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_reserved())
