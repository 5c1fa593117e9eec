"""Packed trials: the reference figures a packed sweep is judged against, in one plain process.

The trials are the ``slots`` section's small ``train`` trials (the MLP on digits; 5 epochs on a
GPU, 2 on a CPU, 1 in ``--quick``), N of them: 256 on a GPU, 32 on a CPU, 8 in ``--quick``.

- ``plain_trials_per_s``: the trials run one at a time in a plain loop (``train`` called
  directly, ``torch.set_num_threads(1)``: one core), over the first few of them
  (``plain_trials``): the rate today's one-slot fleet is compared with;
- ``packed_trials_per_s``: all N trained as one vmapped model (:mod:`tasks.jobproc.packed`),
  model building and data included;
- ``packed_vs_plain``: the one over the other;
- ``accuracy_gap``: the largest difference of a trial's accuracy packed and alone, over the
  trials the plain loop ran (the issue asks for <= 0.01); ``accuracy_mean``: the packed mean.

:func:`fleet_packed_rate` is the fleet's figure beside them: the same trials through
``tasks.sweep(..., pack=K)``; the issue's goals are that over ``plain_trials_per_s`` (>= 50x on a
GPU) and over ``packed_trials_per_s`` (>= 0.5x).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from celery import Celery

from ..core.job import JobContext
from ..core.records import Entry
from ..jobproc.packed import Member, train_pack
from ..jobs.train import TRAIN_PACKING, TrainParams, train
from ..producer.sweep import sweep
from .slots import _trials

logger = logging.getLogger(__name__)


def _context(device: str, torch_device: str, folder: Path, name: str) -> JobContext:
    return JobContext(device=device, torch_device=torch_device, job_id=name, artifacts_dir=folder / name, threads=1)


def measure(*, quick: bool) -> dict[str, Any]:
    """The plain loop's and the packed model's rates and accuracies of the same trials."""
    gpu = torch.cuda.is_available()
    device, torch_device = ("gpu0", "cuda:0") if gpu else ("cpu0", "cpu")
    count = 256 if gpu else (8 if quick else 32)
    trials = _trials(count, gpu, quick)
    plain_count = 2 if quick else (16 if gpu else 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="devicefleet-bench-pack-") as tmp:
            folder = Path(tmp)
            params = [TrainParams(**trial) for trial in trials]
            train(_context(device, torch_device, folder, "warm"), params[0])  # torch, sklearn, the data warm
            started = time.perf_counter()
            alone = [train(_context(device, torch_device, folder, f"alone{i}"), p)
                     for i, p in enumerate(params[:plain_count])]
            plain_s = time.perf_counter() - started
            def on_end(index: int, output: dict[str, Any] | None, error: BaseException | None) -> None:
                raise RuntimeError(f"pack bench: trial {index} failed: {error!r}")

            if gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            members = [Member(_context(device, torch_device, folder, f"packed{i}"), p, TRAIN_PACKING.data(p))
                       for i, p in enumerate(params)]
            ends = train_pack(TRAIN_PACKING, members, torch_device, on_end)
            packed_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    plain_rate, packed_rate = plain_count / plain_s, count / packed_s
    gap = max(abs(ends[i]["accuracy"] - alone[i]["accuracy"]) for i in range(plain_count))
    logger.info("pack: plain %.2f trials/s, packed %.2f trials/s (%d trials), accuracy gap %.4f",
                plain_rate, packed_rate, count, gap)
    return {
        "device": device, "trials": count, "plain_trials": plain_count, "epochs": trials[0]["epochs"],
        "plain_trials_per_s": plain_rate, "packed_trials_per_s": packed_rate, "packed_vs_plain": packed_rate / plain_rate,
        "accuracy_gap": gap, "accuracy_mean": sum(e["accuracy"] for e in ends.values()) / count,
    }


def fleet_packed_rate(app: Celery, device: str, trials: list[dict[str, Any]], pack: int | str = "auto") -> float:
    """Trials per second of ``trials`` through a packed sweep on ``device`` of a running fleet.

    Not yet wired into :func:`measure`: ``sweep(..., pack=)`` comes with the packworker branch;
    the lead wires it (beside the ``slots`` fleet's one-slot rate) after both land.
    """
    started = time.perf_counter()
    entries = sweep("train", trials, device, name=None, app=app, pack=pack).get(timeout=3600)  # type: ignore[call-arg]
    elapsed = time.perf_counter() - started
    bad = [e for e in entries if not Entry.parse(e).ok]
    if bad:
        raise RuntimeError(f"pack bench: {len(bad)} of {len(trials)} packed trials failed: {bad[0]['error']}")
    return len(trials) / elapsed
