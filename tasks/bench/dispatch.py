"""Dispatch overhead: the fleet's own cost, measured with ``noop`` jobs, against plain Celery.

- fan-out round trip: ``fan_out("noop", [cpu0, cpu1]).get()``, repeated; p50 and p99 in ms;
- throughput: one producer sends ``n`` no-op jobs over the device queues and waits for all;
- the same two figures for a plain Celery + Redis setup (:mod:`tasks.bench.plain`), and with the
  ``bench`` extra for Ray (:mod:`tasks.bench.ray_dispatch`).

The fleet and plain Celery run interleaved, ``repeats`` rounds of each (fleet then plain, then
plain then fleet, ...), so a slow minute of a shared host falls on both; each figure is the median
over every round, with each round's own figure beside it (``*_repeats``) for the spread. The
fleet keeps every guarantee on (leases, metrics, registry, events): their cost is in its figures.
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
from ..core.records import Entry
from ..producer.fanout import JobSpec, fan_out
from . import plain, ray_dispatch

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
        bad = [d for d, e in results.items() if not Entry.parse(e).ok]
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
        if not Entry.parse(entry).ok:
            raise RuntimeError(f"noop job failed: {entry}")
    return jobs / (time.perf_counter() - t0)


def measure(app: Celery, devices: list[str], *, quick: bool, cores: list[list[int] | None] | None = None,
            loglevel: str = "INFO") -> dict[str, Any]:
    """``{"fanout_ms_p50", "jobs_per_s", "fanout_vs_plain", "jobs_vs_plain", "plain_*", ...}``
    for ``devices`` (and ``ray_*``, ``fanout_vs_ray`` where Ray is installed and not ``quick``).

    ``cores`` are the devices' cores and ``loglevel`` their workers' level: the plain workers
    get the same. Ratios are the fleet's figure over the other's: ``fanout_vs_plain`` below 1 and
    ``jobs_vs_plain`` above 1 are the fleet ahead.
    """
    runs = 30 if quick else 200
    jobs = 100 if quick else 1000
    repeats = 1 if quick else 3
    fleet_times: list[list[float]] = []
    fleet_rates: list[float] = []
    plain_times: list[list[float]] = []
    plain_rates: list[float] = []
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-plain-") as logs, \
            plain.plain_workers(plain.plain_url(str(app.conf.broker_url)), cores or [None] * len(devices),
                                Path(logs), loglevel) as (producer, queues):
        plain.chord_round_trips(producer, queues, 0)  # warm, as the fleet is by its own warmup
        for repeat in range(repeats):
            def fleet_round() -> None:
                fleet_times.append(fanout_round_trips(app, devices, runs))
                fleet_rates.append(throughput(app, devices, jobs))

            def plain_round() -> None:
                plain_times.append(plain.chord_round_trips(producer, queues, runs))
                plain_rates.append(plain.throughput(producer, queues, jobs))

            for round_ in ((fleet_round, plain_round) if repeat % 2 == 0 else (plain_round, fleet_round)):
                round_()
    fleet_all = [t for times in fleet_times for t in times]
    plain_all = [t for times in plain_times for t in times]
    out: dict[str, Any] = {
        "fanout_ms_p50": 1000 * statistics.median(fleet_all),
        "fanout_ms_p99": 1000 * percentile(fleet_all, 0.99),
        "fanout_ms_p50_repeats": [1000 * statistics.median(times) for times in fleet_times],
        "jobs_per_s": statistics.median(fleet_rates),
        "jobs_per_s_repeats": fleet_rates,
        "plain_chord_ms_p50": 1000 * statistics.median(plain_all),
        "plain_chord_ms_p99": 1000 * percentile(plain_all, 0.99),
        "plain_chord_ms_p50_repeats": [1000 * statistics.median(times) for times in plain_times],
        "plain_jobs_per_s": statistics.median(plain_rates),
        "plain_jobs_per_s_repeats": plain_rates,
        "runs": runs,
        "jobs": jobs,
        "repeats": repeats,
        "devices": devices,
    }
    out["fanout_vs_plain"] = out["fanout_ms_p50"] / out["plain_chord_ms_p50"]
    out["jobs_vs_plain"] = out["jobs_per_s"] / out["plain_jobs_per_s"]
    ray = None if quick else ray_dispatch.measure(len(devices), runs, jobs, repeats)
    if ray is not None:
        out["ray_fanout_ms_p50"] = 1000 * statistics.median(ray["fanout_s"])
        out["ray_fanout_ms_p99"] = 1000 * percentile(ray["fanout_s"], 0.99)
        out["ray_jobs_per_s"] = statistics.median(ray["jobs_per_s"])
        out["ray_jobs_per_s_repeats"] = ray["jobs_per_s"]
        out["fanout_vs_ray"] = out["fanout_ms_p50"] / out["ray_fanout_ms_p50"]
        out["jobs_vs_ray"] = out["jobs_per_s"] / out["ray_jobs_per_s"]
    logger.info("dispatch: %s", out)
    return out
