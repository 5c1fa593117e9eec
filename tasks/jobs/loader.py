"""The data loader that keeps a device fed: a torch DataLoader with background workers.

The built-in ``train`` job and ``devicefleet bench`` (the fed-device benchmark) build their
loaders here, so the benchmark measures the pipeline the job really uses, a producer/consumer
prefetch pipeline (PyTorch's "Multi-process data loading" and "Memory Pinning",
https://pytorch.org/docs/stable/data.html): worker processes produce batches in parallel and hand
them over through shared memory, each worker keeps ``prefetch_factor`` batches ready, and on CUDA
batches are pinned so the host-to-device copy can be ``non_blocking``. Batches travel from the
workers to the loop as shared memory whose descriptors the workers push ahead of them
(:mod:`.handoff`), so the loop never waits on a busy worker for a batch it already made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate, default_convert

from ..core.defaults import LOADER_PREFETCH
from . import handoff

logger = logging.getLogger(__name__)


def build_loader(
    dataset: Dataset[Any],
    *,
    batch_size: int | None,
    num_workers: int,
    cuda: bool,
    shuffle: bool = False,
    seed: int = 0,
    prefetch_factor: int = LOADER_PREFETCH,
    sampler: Sampler[Any] | None = None,
) -> DataLoader[Any]:
    """A DataLoader over ``dataset`` with ``num_workers`` persistent producer processes.

    Args:
        dataset: a map-style dataset; with ``batch_size=None`` each item is already a batch.
        batch_size: samples per batch, or ``None`` when the dataset yields whole batches.
        num_workers: producer processes (0: load in the calling process).
        cuda: the consumer trains on a GPU: pin batches, and spawn (never fork) the workers,
            since a process that initialised CUDA must not fork.
        shuffle: reshuffle each epoch (reproducibly, from ``seed``).
        prefetch_factor: batches each worker keeps ready ahead of the consumer.
        sampler: which samples, in which order (a ``DistributedSampler`` gives a rank its
            shard); it does the shuffling, so ``shuffle`` is ignored.
    """
    workers = max(0, num_workers)
    shared = handoff.Handoff(default_convert if batch_size is None else default_collate, keep=prefetch_factor + 1) \
        if workers > 0 and handoff.supported() else None
    return _Loader(
        dataset,
        shared,
        batch_size=batch_size,
        shuffle=shuffle if sampler is None else None,
        sampler=sampler,
        num_workers=workers,
        collate_fn=shared,
        pin_memory=cuda,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
        multiprocessing_context="spawn" if cuda and workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )


class _Loader(DataLoader[Any]):
    """A DataLoader whose batches come through a :class:`~.handoff.Handoff` (when it has one):
    its iterator turns them back into tensors (the pin-memory thread already has, on CUDA)."""

    def __init__(self, dataset: Dataset[Any], shared: handoff.Handoff | None, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.handoff = shared

    # DataLoader declares its own iterator class; this one yields the restored batches instead.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        if self.handoff is None:
            return batches
        return (handoff.restore(batch) for batch in batches)
