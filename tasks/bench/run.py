"""Run every benchmark against a throwaway embedded fleet and return the figures."""

from __future__ import annotations

import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core.devices import Device, cpu_model_name, usable_cores
from ..core.settings import ARTIFACTS_SUBDIR, Settings
from ..core.worker_config import load_worker_config
from ..ops.fleet import Fleet
from . import ddp, dispatch, efficiency, gpu, pipeline, sweep

logger = logging.getLogger(__name__)


def host_info() -> dict[str, Any]:
    """Where the figures come from: CPU, cores, load, Python, torch."""
    import torch

    return {
        "cpu": cpu_model_name(),
        "cores": len(usable_cores()),
        "load_avg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def run_bench(base: Settings, *, quick: bool = False, cpu_workers: int = 2) -> dict[str, Any]:
    """Start an embedded fleet (``cpu_workers`` CPU devices, each GPU), measure, stop it.

    Returns ``{"host", "quick", "dispatch", "sweep", "fanout", "ddp", "pipeline", "gpu"?}``; ``gpu``
    only where torch sees a CUDA device (``ddp`` needs two CPU devices: the default).
    """
    started = time.perf_counter()
    figures: dict[str, Any] = {"host": host_info(), "quick": quick}
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-") as tmp:
        settings = base.model_copy(update={
            "redis_url": None, "state_dir": Path(tmp), "artifacts_dir": Path(tmp) / ARTIFACTS_SUBDIR,
        })
        with Fleet(settings, cpu_workers=cpu_workers, stop_timeout=30).start() as fleet:
            app = fleet.app()
            devices = list(fleet.workers)
            cpus = [d for d in devices if d.startswith("cpu")]
            figures["devices"] = devices
            # The plain Celery workers of the dispatch baseline: the same cores and log level.
            figures["dispatch"] = dispatch.measure(
                app, cpus, quick=quick, cores=[fleet.workers[d].cores for d in cpus],
                loglevel=load_worker_config(settings.worker_configs_path, Device.parse(cpus[0])).loglevel,
            )
            figures["sweep"] = sweep.measure(app, cpus, quick=quick, jobs_per_s=figures["dispatch"]["jobs_per_s"])
            figures["fanout"] = efficiency.measure(app, cpus, quick=quick)
            ddp_figures = ddp.measure(app, cpus, quick=quick)
            if ddp_figures is not None:
                figures["ddp"] = ddp_figures
            gpu_figures = gpu.measure(app, devices, quick=quick)
            if gpu_figures is not None:
                figures["gpu"] = gpu_figures
    figures["pipeline"] = pipeline.measure(quick=quick)
    figures["host"]["load_avg_1m_end"] = os.getloadavg()[0]
    figures["elapsed_s"] = time.perf_counter() - started
    return figures
