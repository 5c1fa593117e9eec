"""On a CUDA host: the ``train`` job's GPU busy fraction, and a cpu+gpu fan-out (one model per device).

Skipped (``None``) when torch sees no CUDA device or the fleet has no GPU worker.

- ``busy_fraction``: the share of ``torch.cuda.utilization()`` samples (NVML, 50 ms apart, the
  figure ``nvidia-smi`` shows) taken while the ``train`` job runs on ``gpu0``; the job itself
  reports ``1 - data_wait_fraction`` too (``gpu.loader_busy_fraction``).
- ``cpu_plus_gpu_speedup``: two models trained one after another on the GPU, over the same two
  trained at once, one on ``cpu0`` and one on ``gpu0``.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import Any

from celery import Celery

from ..core.records import Entry
from ..producer.fanout import fan_out

logger = logging.getLogger(__name__)


def sample_utilization(
    stop: threading.Event, samples: list[tuple[float, float]], interval_s: float = 0.05
) -> None:
    import torch

    while not stop.wait(interval_s):
        try:
            samples.append((time.time(), float(torch.cuda.utilization(0))))
        except Exception as exc:  # NVML missing: no samples, the job's own figure stands
            logger.warning("cannot read GPU utilization: %s", exc)
            return


def _train(app: Celery, plan: dict[str, tuple[str, dict[str, Any]]]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    results = fan_out(plan, app=app).get(timeout=1800)
    elapsed = time.perf_counter() - t0
    bad = {d: e["error"] for d, e in results.items() if not Entry.parse(e).ok}
    if bad:
        raise RuntimeError(f"GPU bench training failed: {bad}")
    return elapsed, results


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any] | None:
    """GPU figures, or ``None`` when there is no GPU to measure."""
    import torch

    if not torch.cuda.is_available() or "gpu0" not in devices:
        return None
    cpu = next((d for d in devices if d.startswith("cpu")), None)
    epochs = 3 if quick else 50
    cnn = ("train", {"model": "cnn", "epochs": epochs, "batch_size": 256})
    mlp = ("train", {"model": "mlp", "epochs": epochs, "batch_size": 256})

    stop = threading.Event()
    samples: list[tuple[float, float]] = []
    sampler = threading.Thread(target=sample_utilization, args=(stop, samples), daemon=True)
    sampler.start()
    try:
        _, results = _train(app, {"gpu0": cnn})
    finally:
        stop.set()
        sampler.join()
    entry = results["gpu0"]
    output = entry["output"]
    # Only the training loop's window: not the loader workers' start-up nor the checkpoint.
    train_end = datetime.fromisoformat(entry["finished_at"]).timestamp()
    train_start = train_end - float(output["train_s"])
    window = [u for t, u in samples if train_start <= t <= train_end]
    out: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(0),
        "loader_busy_fraction": 1.0 - float(output["data_wait_fraction"]),
        "utilization_samples": len(window),
    }
    out["busy_fraction"] = (sum(window) / len(window) / 100.0) if window else out["loader_busy_fraction"]
    if cpu is not None:
        gpu_mlp_s, _ = _train(app, {"gpu0": mlp})
        gpu_cnn_s, _ = _train(app, {"gpu0": cnn})
        both_s, _ = _train(app, {cpu: mlp, "gpu0": cnn})
        out.update({
            "gpu_sequential_s": gpu_mlp_s + gpu_cnn_s,
            "cpu_plus_gpu_s": both_s,
            "cpu_plus_gpu_speedup": (gpu_mlp_s + gpu_cnn_s) / both_s,
        })
    logger.info("gpu: %s", out)
    return out
