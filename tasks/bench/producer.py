"""Producers in async code: concurrent fan-outs awaited from one event loop, against the same
number waited for from a thread pool over the blocking API, in the same run.

Each round starts ``n`` no-op fan-outs over the CPU devices at once and waits for every result:

- ``async``: one event loop sends them and awaits them all (``asyncio.gather`` of
  ``handle.wait()``: one pub/sub connection, no thread per wait);
- ``threads``: ``n`` threads of a pool each run ``fan_out(...).get()`` (Celery's result consumer).

Figures: the fan-outs per second of each (``*_fanouts_per_s``), their ratio
(``async_fanouts_per_s``: the event loop's rate over the pool's, >= 1 is the event loop ahead)
and the producer process's CPU time per fan-out (``time.process_time``, every thread of the
process) of each, and their ratio (``async_cpu_vs_threads``, <= 1 is the event loop using less).
The two run interleaved (async then threads, then threads then async, ...), and each figure is
the median over the rounds.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery

from ..core.records import Entry
from ..producer.client import FleetClient
from ..producer.fanout import fan_out

logger = logging.getLogger(__name__)


def _check(results: list[dict[str, dict[str, Any]]]) -> None:
    bad = [entry for result in results for entry in result.values() if not Entry.parse(entry).ok]
    if bad:
        raise RuntimeError(f"no-op fan-outs failed: {bad[:3]}")


def async_round(app: Celery, devices: list[str], n: int) -> None:
    """``n`` concurrent no-op fan-outs, sent and awaited from one event loop."""
    async def main() -> list[dict[str, dict[str, Any]]]:
        async with FleetClient(app) as client:
            handles = [client.fan_out("noop", devices) for _ in range(n)]
            return list(await asyncio.gather(*(handle.wait(timeout=120) for handle in handles)))

    _check(asyncio.run(main()))


def threads_round(pool: ThreadPoolExecutor, app: Celery, devices: list[str], n: int) -> None:
    """``n`` concurrent no-op fan-outs, each sent and waited for by a thread of ``pool``."""
    _check(list(pool.map(lambda _: fan_out("noop", devices, app=app).get(timeout=120), range(n))))


def _timed(run: Callable[[], None], n: int) -> tuple[float, float]:
    """``(fan-outs per second, CPU seconds of this process per fan-out)`` of one round."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return n / (time.perf_counter() - wall), (time.process_time() - cpu) / n


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any]:
    """``{"async_fanouts_per_s", "async_cpu_vs_threads", "async_rate", "threads_rate", ...}``
    (see the module's docstring)."""
    n = 20 if quick else 50
    repeats = 1 if quick else 5
    rates: dict[str, list[float]] = {"async": [], "threads": []}
    cpus: dict[str, list[float]] = {"async": [], "threads": []}
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="bench-producer") as pool:
        rounds = {"async": lambda: async_round(app, devices, n),
                  "threads": lambda: threads_round(pool, app, devices, n)}
        for run in rounds.values():  # warm: connections, the pool's threads, Celery's consumer
            run()
        for repeat in range(repeats):
            for name in (("async", "threads") if repeat % 2 == 0 else ("threads", "async")):
                rate, cpu = _timed(rounds[name], n)
                rates[name].append(rate)
                cpus[name].append(cpu)
    out: dict[str, Any] = {
        "async_rate": statistics.median(rates["async"]),
        "threads_rate": statistics.median(rates["threads"]),
        "async_cpu_ms_per_fanout": 1000 * statistics.median(cpus["async"]),
        "threads_cpu_ms_per_fanout": 1000 * statistics.median(cpus["threads"]),
        "async_rate_repeats": rates["async"],
        "threads_rate_repeats": rates["threads"],
        "concurrent": n,
        "repeats": repeats,
        "devices": devices,
    }
    out["async_fanouts_per_s"] = out["async_rate"] / out["threads_rate"]
    out["async_cpu_vs_threads"] = out["async_cpu_ms_per_fanout"] / out["threads_cpu_ms_per_fanout"]
    logger.info("producer: %s", out)
    return out
