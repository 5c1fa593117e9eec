"""The dispatch round trip on Ray (optional extra ``bench``): what peers compare the fleet with.

The same two figures as :mod:`.dispatch`: a fan-out of one no-op task per device, waited for
(``ray.get([noop.remote() for each device])``), and one producer's no-op tasks per second
(all submitted, then all waited for). Ray runs locally with as many CPUs as the fleet has
devices.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .ray_pipeline import available

logger = logging.getLogger(__name__)


def _noop() -> None:
    return None


def measure(devices: int, runs: int, jobs: int, repeats: int, warmup: int = 20) -> dict[str, Any] | None:
    """``{"fanout_s": [...], "jobs_per_s": [...]}`` over ``repeats`` rounds; ``None`` when Ray is
    not installed. Each round: ``runs`` timed fan-outs of ``devices`` tasks, then ``jobs`` tasks."""
    if not available():
        return None
    import ray

    ray.init(num_cpus=devices, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        noop = ray.remote(num_cpus=1)(_noop)
        for _ in range(warmup):  # worker processes started and warm
            ray.get([noop.remote() for _ in range(devices)])
        fanout_s: list[float] = []
        rates: list[float] = []
        for _ in range(repeats):
            for _ in range(runs):
                t0 = time.perf_counter()
                ray.get([noop.remote() for _ in range(devices)])
                fanout_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get([noop.remote() for _ in range(jobs)])
            rates.append(jobs / (time.perf_counter() - t0))
    finally:
        ray.shutdown()
    logger.info("ray dispatch: %d fan-outs, jobs/s %s", len(fanout_s), rates)
    return {"fanout_s": fanout_s, "jobs_per_s": rates}
