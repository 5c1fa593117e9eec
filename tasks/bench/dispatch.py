"""Dispatch overhead: the fleet's own cost, measured with ``noop`` jobs.

- fan-out round trip: ``fan_out("noop", [cpu0, cpu1]).get()``, repeated; p50 and p99 in ms;
- throughput: one producer sends ``n`` no-op jobs over the device queues and waits for all;
- the same two figures for a plain Celery + Redis setup (:mod:`tasks.bench.plain`), side by side.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import Celery

from ..core.queues import device_queue
from ..producer.fanout import JobSpec, fan_out
from . import plain

logger = logging.getLogger(__name__)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, by linear interpolation."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def fanout_round_trips(app: Celery, devices: list[str], runs: int, warmup: int = 5) -> list[float]:
    """Seconds per ``fan_out("noop", devices).get()``, ``runs`` times after ``warmup``."""
    times: list[float] = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        results = fan_out("noop", devices, app=app).get(timeout=60)
        elapsed = time.perf_counter() - t0
        bad = [d for d, e in results.items() if e["status"] != "ok"]
        if bad:
            raise RuntimeError(f"noop fan-out failed on {bad}: {results}")
        if i >= warmup:
            times.append(elapsed)
    return times


def throughput(app: Celery, devices: list[str], jobs: int) -> float:
    """No-op jobs per second that one producer gets through the device workers."""
    noop = JobSpec.of("noop")
    sigs = [noop.signature(app, device_queue(d)) for d in devices]
    t0 = time.perf_counter()
    results = [sigs[i % len(sigs)].apply_async() for i in range(jobs)]
    for res in results:
        entry = res.get(timeout=120)
        if entry["status"] != "ok":
            raise RuntimeError(f"noop job failed: {entry}")
    return jobs / (time.perf_counter() - t0)


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any]:
    """``{"fanout_ms_p50", "fanout_ms_p99", "jobs_per_s", "plain_*", ...}`` for ``devices``.

    The ``plain_*`` figures are the baseline of :mod:`tasks.bench.plain`, measured in the same
    run on the same Redis: a two-job chord and one producer's throughput.
    """
    runs = 30 if quick else 300
    jobs = 100 if quick else 2000
    times = fanout_round_trips(app, devices, runs)
    rate = throughput(app, devices, jobs)
    out = {
        "fanout_ms_p50": 1000 * statistics.median(times),
        "fanout_ms_p99": 1000 * percentile(times, 0.99),
        "jobs_per_s": rate,
        "runs": runs,
        "jobs": jobs,
        "devices": devices,
    }
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-plain-") as logs, \
            plain.plain_workers(plain.plain_url(str(app.conf.broker_url)), len(devices), Path(logs)) as (producer, queues):
        plain_times = plain.chord_round_trips(producer, queues, runs)
        out["plain_chord_ms_p50"] = 1000 * statistics.median(plain_times)
        out["plain_chord_ms_p99"] = 1000 * percentile(plain_times, 0.99)
        out["plain_jobs_per_s"] = plain.throughput(producer, queues, jobs)
    logger.info("dispatch: %s", out)
    return out
