"""Sweeps: what the sweep layer costs, and how well it keeps every device busy.

- ``trials_per_s``: no-op trials through :func:`tasks.sweep` on the CPU devices, compared with
  the fleet's own ``dispatch.jobs_per_s`` of the same run (``vs_jobs_per_s``);
- ``makespan_ratio``: ``probe`` trials of known mixed lengths (sleeps: the figure is about
  scheduling, not compute) through one sweep: wall time over the best any schedule could do,
  ``max(total work / devices, longest trial)``; ``waves_ratio``: the same trials as waves of
  :func:`tasks.fan_out` (one trial per device per wave, each wave waiting for its slowest);
- ``ray_tune_trials_per_s`` (full runs, with the ``bench`` extra): Ray Tune running the same
  number of trivial trials, one CPU each, in this process.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import tempfile
import time
from typing import Any

from celery import Celery

from ..core.records import Entry
from ..producer.fanout import fan_out
from ..producer.sweep import sweep
from .ray_pipeline import available as ray_available

logger = logging.getLogger(__name__)


def trial_lengths(count: int, longest_s: float, seed: int = 0) -> list[float]:
    """``count`` trial lengths spread between ``longest_s / 8`` and ``longest_s`` (fixed seed)."""
    rng = random.Random(seed)
    return [round(longest_s * rng.choice((0.125, 0.25, 0.5, 1.0)), 4) for _ in range(count)]


def ideal_makespan(lengths: list[float], devices: int) -> float:
    """The lower bound of any schedule: the work spread evenly, or the longest trial."""
    return max(sum(lengths) / devices, max(lengths))


def _check(entries: list[dict[str, Any]], what: str) -> None:
    bad = [e for e in entries if not Entry.parse(e).ok]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} trials failed, first: {bad[0]}")


def trials_per_s(app: Celery, devices: list[str], trials: int) -> float:
    """No-op trials per second through one sweep over ``devices``."""
    t0 = time.perf_counter()
    entries = sweep("noop", [{}] * trials, devices, app=app).get(timeout=600)
    elapsed = time.perf_counter() - t0
    _check(entries, "no-op sweep")
    return trials / elapsed


def sweep_makespan(app: Celery, devices: list[str], lengths: list[float]) -> float:
    """Wall seconds of one sweep of ``probe`` trials sleeping ``lengths``."""
    trials = [{"busy_s": s, "mode": "sleep"} for s in lengths]
    t0 = time.perf_counter()
    entries = sweep("probe", trials, devices, app=app).get(timeout=600)
    elapsed = time.perf_counter() - t0
    _check(entries, "mixed-length sweep")
    return elapsed


def waves_makespan(app: Celery, devices: list[str], lengths: list[float]) -> float:
    """Wall seconds of the same trials as waves of fan-outs, one trial per device per wave."""
    t0 = time.perf_counter()
    for start in range(0, len(lengths), len(devices)):
        wave = lengths[start:start + len(devices)]
        plan = {d: ("probe", {"busy_s": s, "mode": "sleep"}) for d, s in zip(devices, wave, strict=False)}
        _check(list(fan_out(plan, app=app).get(timeout=600).values()), "fan-out wave")
    return time.perf_counter() - t0


def ray_tune_trials_per_s(trials: int, cpus: int) -> float | None:
    """Trivial trials per second through Ray Tune (``num_samples=trials``, 1 CPU each);
    None without Ray Tune (``ray[tune]``, in the ``bench`` extra)."""
    if not ray_available():
        return None
    import ray

    try:
        from ray import tune
    except ImportError as exc:  # Ray without its Tune dependencies (pandas, pyarrow)
        logger.warning("no Ray Tune column: %s", exc)
        return None

    def trivial(config: dict[str, Any]) -> dict[str, Any]:
        return {"score": config["x"]}

    # Tune prints its experiment table on stdout, where `bench --json` prints the figures.
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-tune-") as storage, \
            contextlib.redirect_stdout(sys.stderr):
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            t0 = time.perf_counter()
            results = tune.Tuner(tune.with_resources(trivial, {"cpu": 1}),
                                 param_space={"x": tune.uniform(0, 1)},
                                 tune_config=tune.TuneConfig(num_samples=trials),
                                 run_config=tune.RunConfig(verbose=0, storage_path=storage)).fit()
            elapsed = time.perf_counter() - t0
        finally:
            ray.shutdown()
    if results.errors:
        raise RuntimeError(f"Ray Tune: {len(results.errors)} trials failed: {results.errors[0]}")
    return trials / elapsed


def measure(app: Celery, devices: list[str], *, quick: bool, jobs_per_s: float | None = None) -> dict[str, Any]:
    """The sweep figures over ``devices``; ``jobs_per_s`` is the same run's dispatch figure."""
    count = 20 if quick else 40
    lengths = trial_lengths(count, 0.1 if quick else 0.4)
    noop_trials = 100 if quick else 1000
    out: dict[str, Any] = {"trials": count, "devices": devices, "work_s": sum(lengths),
                           "ideal_s": ideal_makespan(lengths, len(devices))}
    out["trials_per_s"] = trials_per_s(app, devices, noop_trials)
    if jobs_per_s:
        out["vs_jobs_per_s"] = out["trials_per_s"] / jobs_per_s
    out["sweep_s"] = sweep_makespan(app, devices, lengths)
    out["waves_s"] = waves_makespan(app, devices, lengths)
    out["makespan_ratio"] = out["sweep_s"] / out["ideal_s"]
    out["waves_ratio"] = out["waves_s"] / out["ideal_s"]
    if not quick:
        # Ray Tune takes about a second per trivial trial here: a smaller count, the same trials.
        out["ray_tune_trials"] = min(noop_trials, 50)
        rate = ray_tune_trials_per_s(out["ray_tune_trials"], len(devices))
        if rate is not None:
            out["ray_tune_trials_per_s"] = rate
    logger.info("sweep: %s", out)
    return out
