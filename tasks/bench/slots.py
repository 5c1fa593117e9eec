"""Slots: small ``train`` trials through one sweep on one device, with one slot and with several.

The device is ``gpu0`` where torch sees a GPU, else ``cpu0``. For each slot count the bench
starts a fleet of its own (one CPU worker with every core, and the GPU's worker on a GPU host)
whose worker configs say ``slots = N``, runs the same sweep of small ``train`` trials on the
device, and stops it; every count runs the same trials in the same run.

- ``trials_per_s_<N>``: trials per second with N slots;
- ``trials_per_s_vs_one``: the most slots' rate over one slot's (the issue's figure);
- ``busy_fraction_<N>``: on a GPU, the share of ``torch.cuda.utilization()`` samples (NVML,
  50 ms apart) over the sweep; on a CPU device, the host's CPU use over the sweep
  (``psutil.cpu_percent``), the same kind of figure for cores.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from ..core.records import Entry
from ..core.settings import Settings
from ..ops.fleet import Fleet
from ..producer.fanout import fan_out
from ..producer.sweep import sweep
from .gpu import sample_utilization

logger = logging.getLogger(__name__)


def write_slot_configs(source: Path, dest: Path, slots: int) -> Path:
    """Copy every ``*.toml`` of ``source`` into ``dest`` with ``slots`` set; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.toml")):
        text = re.sub(r"(?m)^[ \t]*(slots|concurrency)[ \t]*=.*\n?", "", path.read_text())
        (dest / path.name).write_text(f"# devicefleet bench: {slots} slot(s)\nslots = {slots}\n\n{text}")
    return dest


def _trials(count: int, gpu: bool, quick: bool) -> list[dict[str, Any]]:
    """Small ``train`` trials: the MLP on digits, a learning rate and a seed each."""
    epochs = 1 if quick else (5 if gpu else 2)
    return [{"model": "mlp", "epochs": epochs, "lr": 3e-3 * (1 + i % 4), "seed": i, "num_workers": 0,
             "checkpoint_every_s": 3600.0} for i in range(count)]


def _sweep_rate(base: Settings, folder: Path, slots: int, device: str, trials: list[dict[str, Any]],
                gpu: bool) -> tuple[float, float | None]:
    """``(trials per second, busy fraction)`` of one sweep of ``trials`` on ``device`` with ``slots``."""
    configs = write_slot_configs(base.worker_configs_path, folder / f"configs-{slots}", slots)
    settings = base.model_copy(update={"redis_url": None, "state_dir": folder / f"state-{slots}",
                                       "worker_configs_dir": configs})
    with Fleet(settings, cpu_workers=1, gpus=1 if gpu else 0, stop_timeout=30, metrics=False).start() as fleet:
        app = fleet.app()
        # Every slot's process warm: torch, scikit-learn and the data loaded, as in a long sweep.
        fan_out(("train", {**trials[0], "epochs": 1}), device, per_slot=True, app=app).get(timeout=600)
        stop = threading.Event()
        samples: list[tuple[float, float]] = []
        sampler = threading.Thread(target=sample_utilization, args=(stop, samples), daemon=True) if gpu else None
        if sampler is not None:
            sampler.start()
        psutil.cpu_percent()  # the CPU figure counts from here
        t0 = time.perf_counter()
        try:
            entries = sweep("train", trials, device, name=None, app=app).get(timeout=3600)
        finally:
            elapsed = time.perf_counter() - t0
            cpu = psutil.cpu_percent() / 100.0
            stop.set()
            if sampler is not None:
                sampler.join()
    bad = [e for e in entries if not Entry.parse(e).ok]
    if bad:
        raise RuntimeError(f"slots bench: {len(bad)} of {len(trials)} trials failed with {slots} slots: {bad[0]['error']}")
    busy = (sum(u for _, u in samples) / len(samples) / 100.0 if samples else None) if gpu else cpu
    return len(trials) / elapsed, busy


def measure(base: Settings, *, quick: bool) -> dict[str, Any]:
    """The slot figures of ``gpu0`` (on a GPU host) or ``cpu0``."""
    import torch

    gpu = torch.cuda.is_available()
    device = "gpu0" if gpu else "cpu0"
    cores = len(psutil.Process().cpu_affinity() or []) or (psutil.cpu_count() or 1)
    most = 8 if gpu else max(2, min(cores, 8))
    counts = sorted({1, 2, most} if quick else {1, 2, 4, most} if gpu else {1, most})
    trials = _trials(max(most * (1 if quick else 8), 8), gpu, quick)
    out: dict[str, Any] = {"device": device, "trials": len(trials), "slots": counts}
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-slots-") as tmp:
        for slots in counts:
            rate, busy = _sweep_rate(base, Path(tmp), slots, device, trials, gpu)
            out[f"trials_per_s_{slots}"] = rate
            out[f"busy_fraction_{slots}"] = busy
            logger.info("slots: %d on %s: %.2f trials/s, busy %s", slots, device, rate, busy)
    out["trials_per_s_vs_one"] = out[f"trials_per_s_{counts[-1]}"] / out["trials_per_s_1"]
    out["busy_fraction"] = out[f"busy_fraction_{counts[-1]}"]
    return out
