"""Slots: small ``train`` trials through one sweep on one device, with one slot and with several.

The device is ``gpu0`` where torch sees a GPU, else ``cpu0``. For each slot count the bench
starts a fleet of its own (one CPU worker with every core, and the GPU's worker on a GPU host)
whose worker configs say ``slots = N``, runs the same sweep of small ``train`` trials on the
device, and stops it; every count runs the same trials in the same run. ``--quick`` on a CPU
host starts no fleet when given the bench's own (:func:`tasks.bench.run.run_bench` gives its
``cpu1`` :data:`QUICK_SLOTS` slots, :func:`give_slots`): it sweeps on ``cpu0`` (one slot), then
on ``cpu1``, each worker with its own cores as the bench's fleet has them; without that fleet it
starts one, with a CPU worker per count (``cpu0`` with one slot, ``cpu1`` with the most), each
with every core, and sweeps on one, then the other: the other worker idles meanwhile. Either
saves fleets' starts and stops (a smoke run, whose figures are not judged).

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
from celery import Celery

from ..core.devices import Device, format_core_list, usable_cores
from ..core.records import Entry
from ..core.settings import Settings
from ..core.worker_config import config_file
from ..ops.fleet import Fleet
from ..producer.fanout import fan_out
from ..producer.sweep import sweep
from .gpu import sample_utilization

logger = logging.getLogger(__name__)


def _with_slots(text: str, slots: int) -> str:
    text = re.sub(r"(?m)^[ \t]*(slots|concurrency)[ \t]*=.*\n?", "", text)
    return f"# devicefleet bench: {slots} slot(s)\nslots = {slots}\n\n{text}"


def write_slot_configs(source: Path, dest: Path, slots: int, devices: dict[str, int] | None = None) -> Path:
    """Copy every ``*.toml`` of ``source`` into ``dest`` with ``slots`` set, and give each of
    ``devices`` (``{"cpu1": 2}``) a file of its own, its config's copy with its own slots;
    returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.toml")):
        (dest / path.name).write_text(_with_slots(path.read_text(), slots))
    for device, count in (devices or {}).items():
        text = config_file(source, Device.parse(device)).read_text()
        (dest / f"{device}.toml").write_text(_with_slots(text, count))
    return dest


#: ``cpu1``'s slots in the bench's own fleet in ``--quick`` on a CPU host (the slots section's
#: second count there).
QUICK_SLOTS = 2


def on_bench_fleet(quick: bool, cpu_workers: int) -> bool:
    """Whether the section runs on the bench's own fleet (``--quick`` on a CPU host with two
    CPU workers or more), whose ``cpu1`` then needs :data:`QUICK_SLOTS` slots (:func:`give_slots`)."""
    import torch

    return quick and cpu_workers >= 2 and not torch.cuda.is_available()


def give_slots(folder: Path, device: str, slots: int) -> None:
    """Give ``device`` a config file of its own in ``folder``: its config's copy with ``slots``."""
    text = config_file(folder, Device.parse(device)).read_text()
    (folder / f"{device}.toml").write_text(_with_slots(text, slots))


def _trials(count: int, gpu: bool, quick: bool) -> list[dict[str, Any]]:
    """Small ``train`` trials: the MLP on digits, a learning rate and a seed each."""
    epochs = 1 if quick else (5 if gpu else 2)
    return [{"model": "mlp", "epochs": epochs, "lr": 3e-3 * (1 + i % 4), "seed": i, "num_workers": 0,
             "checkpoint_every_s": 3600.0} for i in range(count)]


def _fleet(base: Settings, folder: Path, name: str, slots: int, gpu: bool, *,
           per_worker: list[int] | None = None) -> Fleet:
    """A fleet of its own whose worker configs say ``slots`` (not started): one CPU worker with
    every core (and the GPU's on a GPU host), or with ``per_worker``, a CPU worker per entry
    (``cpu<i>`` with that many slots), each with every core."""
    devices = {f"cpu{i}": count for i, count in enumerate(per_worker or [])}
    configs = write_slot_configs(base.worker_configs_path, folder / f"configs-{name}", slots, devices)
    settings = base.model_copy(update={"redis_url": None, "state_dir": folder / f"state-{name}",
                                       "worker_configs_dir": configs})
    every_core = {"DEVICEFLEET_CORES": format_core_list(usable_cores())} if per_worker else {}
    return Fleet(settings, cpu_workers=len(devices) or 1, gpus=1 if gpu else 0, stop_timeout=30, metrics=False,
                 extra_env=every_core)


def _sweep_rate(app: Celery, slots: int, device: str, trials: list[dict[str, Any]],
                gpu: bool) -> tuple[float, float | None]:
    """``(trials per second, busy fraction)`` of one sweep of ``trials`` on ``device`` (``slots``
    of them) of a running fleet."""
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


def measure(base: Settings, *, quick: bool, app: Celery | None = None) -> dict[str, Any]:
    """The slot figures of ``gpu0`` (on a GPU host) or ``cpu0`` (``device_<N>``: where N slots
    ran: ``cpu<i>`` in ``--quick`` on a CPU host). ``app``: the bench's running fleet, whose
    ``cpu1`` has :data:`QUICK_SLOTS` slots, where :func:`on_bench_fleet` says so."""
    import torch

    gpu = torch.cuda.is_available()
    device = "gpu0" if gpu else "cpu0"
    cores = len(psutil.Process().cpu_affinity() or []) or (psutil.cpu_count() or 1)
    most = 8 if gpu else QUICK_SLOTS if app is not None else max(2, min(cores, 8))
    counts = sorted({1, 2, most} if quick else {1, 2, 4, most} if gpu else {1, most})
    trials = _trials(max(most * (1 if quick else 8), 8), gpu, quick)
    out: dict[str, Any] = {"device": device, "trials": len(trials), "slots": counts}

    def record(slots: int, on: str, rate: float, busy: float | None) -> None:
        out[f"trials_per_s_{slots}"] = rate
        out[f"busy_fraction_{slots}"] = busy
        out[f"device_{slots}"] = on
        logger.info("slots: %d on %s: %.2f trials/s, busy %s", slots, on, rate, busy)

    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-slots-") as tmp:
        def each_worker(on: Celery) -> None:  # cpu<i> has counts[i] slots
            for index, slots in enumerate(counts):
                record(slots, f"cpu{index}", *_sweep_rate(on, slots, f"cpu{index}", trials, gpu))

        if app is not None:
            each_worker(app)
        elif quick and not gpu:
            with _fleet(base, Path(tmp), "quick", 1, gpu, per_worker=counts).start() as fleet:
                each_worker(fleet.app())
        else:
            for slots in counts:
                with _fleet(base, Path(tmp), str(slots), slots, gpu).start() as fleet:
                    record(slots, device, *_sweep_rate(fleet.app(), slots, device, trials, gpu))
    out["trials_per_s_vs_one"] = out[f"trials_per_s_{counts[-1]}"] / out["trials_per_s_1"]
    out["busy_fraction"] = out[f"busy_fraction_{counts[-1]}"]
    return out
