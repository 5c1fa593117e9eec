"""Run every benchmark against a throwaway embedded fleet and return the figures."""

from __future__ import annotations

import logging
import os
import platform
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..core.devices import Device, cpu_model_name, usable_cores
from ..core.errors import ConfigError
from ..core.settings import ARTIFACTS_SUBDIR, Settings
from ..core.worker_config import load_worker_config
from ..ops.fleet import Fleet
from . import (
    commands,
    ddp,
    dispatch,
    efficiency,
    gpu,
    group_start,
    groups,
    isolation,
    pack,
    pipeline,
    producer,
    scale,
    slots,
    sweep,
)

#: The sections of a bench run, in the order they run (``pipeline`` needs no fleet; ``groups``
#: measures its start and wait figures on the fleet, its Hogwild ones without it).
SECTIONS = ("dispatch", "producer", "sweep", "fanout", "ddp", "gpu", "commands", "isolation", "slots", "pack",
            "pipeline", "groups", "scale")

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


@contextmanager
def _timed(figures: dict[str, Any], section: str) -> Iterator[None]:
    """Time one section into ``figures["sections_s"]`` (where a bench run's time goes)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        figures.setdefault("sections_s", {})[section] = round(time.perf_counter() - started, 2)


def run_bench(base: Settings, *, quick: bool = False, cpu_workers: int = 2,
              sections: Collection[str] | None = None) -> dict[str, Any]:
    """Start an embedded fleet (``cpu_workers`` CPU devices, each GPU), measure, stop it.

    ``sections`` picks some of :data:`SECTIONS` (default: all). Returns ``{"host", "quick",
    "dispatch", "producer", "sweep", "fanout", "ddp", "commands", "isolation", "slots", "pack", "pipeline",
    "groups", "gpu"?}`` (those picked); ``gpu`` only where torch sees a CUDA device (``ddp`` needs two CPU
    devices: the default; ``groups`` two usable cores).

    The fleet also runs the misbehaving jobs of :mod:`.misbehave` and a short ``cancel_grace_s``
    (:data:`.isolation.CANCEL_GRACE_S`), for the ``isolation`` section, and its worker configs
    allow this interpreter in a throwaway folder (``[commands]``), for the ``commands`` section.

    Raises:
        ConfigError: a section that is not one of :data:`SECTIONS`.
    """
    chosen = set(SECTIONS if sections is None else sections)
    unknown = sorted(chosen - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown bench section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    started = time.perf_counter()
    figures: dict[str, Any] = {"host": host_info(), "quick": quick}
    modules = [*base.job_modules, *([] if isolation.JOB_MODULE in base.job_modules else [isolation.JOB_MODULE])]
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-") as tmp:
        configs = isolation.write_worker_configs(base.worker_configs_path, Path(tmp) / "worker_configs")
        workdir = Path(tmp) / "commands"
        workdir.mkdir()
        commands.write_commands_table(configs, workdir)
        slots_on_fleet = "slots" in chosen and slots.on_bench_fleet(quick, cpu_workers)
        if slots_on_fleet:  # --quick on a CPU host: the slots section sweeps on this fleet's cpu0 and cpu1
            slots.give_slots(configs, "cpu1", slots.QUICK_SLOTS)
        settings = base.model_copy(update={
            "redis_url": None, "state_dir": Path(tmp), "artifacts_dir": Path(tmp) / ARTIFACTS_SUBDIR,
            "worker_configs_dir": configs, "job_modules": modules,
        })
        if slots_on_fleet or chosen - {"pipeline", "slots"}:  # groups: its start and wait figures (the Hogwild ones need none)
            with _timed(figures, "fleet"), Fleet(settings, cpu_workers=cpu_workers, stop_timeout=30).start() as fleet:
                _measure_fleet(fleet, settings, chosen - ({"slots"} if not slots_on_fleet else set()), quick,
                               figures, workdir)
        if "slots" in chosen and not slots_on_fleet:  # fleets of its own, one per slot count
            with _timed(figures, "slots"):
                figures["slots"] = slots.measure(settings, quick=quick)
    if "pipeline" in chosen:
        with _timed(figures, "pipeline"):
            figures["pipeline"] = pipeline.measure(quick=quick)
    groups_figures = None
    if "groups" in chosen:
        with _timed(figures, "hogwild"):
            groups_figures = groups.measure(quick=quick)
    if groups_figures is not None or "group_start" in figures:
        figures["groups"] = {**(groups_figures or {}), **figures.pop("group_start", {})}
    figures["host"]["load_avg_1m_end"] = os.getloadavg()[0]
    figures["elapsed_s"] = time.perf_counter() - started
    return figures


def _measure_fleet(fleet: Fleet, settings: Settings, chosen: set[str], quick: bool,
                   figures: dict[str, Any], workdir: Path) -> None:
    app = fleet.app()
    devices = list(fleet.workers)
    cpus = [d for d in devices if d.startswith("cpu")]
    figures["devices"] = devices
    config = load_worker_config(settings.worker_configs_path, Device.parse(cpus[0]))
    if "dispatch" in chosen:
        with _timed(figures, "dispatch"):
            # The plain Celery workers of the dispatch baseline: the same cores and log level.
            figures["dispatch"] = dispatch.measure(
                app, cpus, quick=quick, cores=[fleet.workers[d].cores for d in cpus], loglevel=config.loglevel,
            )
    if "producer" in chosen:
        with _timed(figures, "producer"):
            figures["producer"] = producer.measure(app, cpus, quick=quick)
    if "sweep" in chosen:
        with _timed(figures, "sweep"):
            figures["sweep"] = sweep.measure(app, cpus, quick=quick,
                                             jobs_per_s=figures.get("dispatch", {}).get("jobs_per_s"))
    if "fanout" in chosen:
        with _timed(figures, "fanout"):
            figures["fanout"] = efficiency.measure(app, cpus, quick=quick)
    if "ddp" in chosen:
        with _timed(figures, "ddp"):
            if (ddp_figures := ddp.measure(app, cpus, quick=quick)) is not None:
                figures["ddp"] = ddp_figures
    if "gpu" in chosen:
        with _timed(figures, "gpu"):
            if (gpu_figures := gpu.measure(app, devices, quick=quick)) is not None:
                figures["gpu"] = gpu_figures
    if "pack" in chosen:  # one plain process, then the same trials on the fleet's first device
        with _timed(figures, "pack"):
            figures["pack"] = pack.measure_fleet(app, devices, pack.measure(quick=quick), quick=quick)
    if "commands" in chosen:
        with _timed(figures, "commands"):
            figures["commands"] = commands.measure(app, cpus[0], workdir, quick=quick)
    if "groups" in chosen:
        with _timed(figures, "group_start"):
            if (start_figures := group_start.measure(app, cpus, quick=quick)) is not None:
                figures["group_start"] = start_figures  # joins the Hogwild figures in the groups section
    if "slots" in chosen:  # --quick on a CPU host (slots.on_bench_fleet): before isolation's crashes
        with _timed(figures, "slots"):
            figures["slots"] = slots.measure(settings, quick=quick, app=app)
    if "scale" in chosen:
        with _timed(figures, "scale"):
            figures["scale"] = scale.measure(app, cpus, quick=quick)
    if "isolation" in chosen:  # last: it crashes and kills job processes
        with _timed(figures, "isolation"):
            figures["isolation"] = isolation.measure(app, cpus[0], quick=quick, cancel_grace_s=config.cancel_grace_s)
