"""A fed device: the mean wait for the next batch, with :mod:`.workload`'s workload.

Each batch takes ``latency_s`` of waiting (disk, network) and then some computation, and is a
``(4, elements, 3)`` float32 array with ``(4, 1)`` labels; each train step takes ``step_s``.
Three ways to feed the step (and Ray's, :mod:`.ray_pipeline`, when it is installed):

- ``sequential``: produce the next batch, then train on it;
- ``mp_queue``: producer processes put batches on a ``multiprocessing.Queue`` (pickled);
- ``fleet``: the ``train`` job's loader, :func:`tasks.jobs.loader.build_loader` (DataLoader workers,
  prefetch, batches handed over as shared memory the workers push ahead of them
  (:mod:`tasks.jobs.handoff`), pinned memory on CUDA).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import warnings
from typing import Any

import torch
from torch.utils.data import Dataset

from ..core.defaults import LOADER_PREFETCH
from ..jobs.loader import build_loader
from . import ray_pipeline
from .workload import Workload, consume, make_batch

logger = logging.getLogger(__name__)


class SlowBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``len`` batches of :func:`make_batch`; each item is already a batch."""

    def __init__(self, work: Workload, length: int) -> None:
        self.work = work
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(index, self.work)


def wait_sequential(work: Workload, batches: int) -> float:
    """Produce, then train, one batch at a time."""
    return consume((make_batch(i, work) for i in range(batches)), batches, 1, work.step_s)


def _producer(indices: list[int], work: Workload, queue: Any) -> None:
    torch.set_num_threads(1)
    for i in indices:
        x, y = make_batch(i, work)
        queue.put((x.numpy(), y.numpy()))


def wait_mp_queue(work: Workload) -> float:
    """``work.producers`` processes put numpy batches on a bounded ``multiprocessing.Queue``."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue(maxsize=2 * work.producers)
    total = work.warmup + work.batches
    procs = [
        ctx.Process(target=_producer, args=(list(range(p, total, work.producers)), work, queue), daemon=True)
        for p in range(work.producers)
    ]
    for proc in procs:
        proc.start()
    try:
        return consume(iter(queue.get, None), total, work.warmup, work.step_s)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def wait_fleet(work: Workload) -> float:
    """The ``train`` job's loader over the same batches (pinned + non-blocking copy on CUDA)."""
    cuda = torch.cuda.is_available()
    total = work.warmup + work.batches
    to_device = None
    if cuda:
        def to_device(batch: Any) -> Any:
            return [t.to("cuda", non_blocking=True) for t in batch]
    with warnings.catch_warnings():
        # More workers than cores on purpose: they mostly wait (latency_s), which needs no core.
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        loader = build_loader(SlowBatches(work, total), batch_size=None, num_workers=work.producers,
                              cuda=cuda, prefetch_factor=LOADER_PREFETCH)
        return consume(loader, total, work.warmup, work.step_s, to_device)


def measure(*, quick: bool) -> dict[str, Any]:
    """``{"wait_s_sequential", "wait_s_mp_queue", "wait_s_fleet", ...}`` (and ``wait_s_ray``)."""
    # Quick (CI's smoke run): every figure, from a few short batches and two producers.
    work = (Workload(latency_s=0.1, step_s=0.02, elements=100_000, batches=8, warmup=4, producers=2)
            if quick else Workload())
    out: dict[str, Any] = {
        "latency_s": work.latency_s, "step_s": work.step_s, "batch_shape": [4, work.elements, 3],
        "producers": work.producers, "batches": work.batches,
        "wait_s_sequential": wait_sequential(work, 2 if quick else 10),
        "wait_s_mp_queue": wait_mp_queue(work),
        "wait_s_fleet": wait_fleet(work),
    }
    ray_wait = ray_pipeline.wait_ray(work) if not quick else None
    if ray_wait is not None:
        out["wait_s_ray"] = ray_wait
    logger.info("pipeline: %s", out)
    return out
