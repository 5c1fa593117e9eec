"""The order a ``train`` run sees its samples in, epoch after epoch, from its seed.

``train``'s DataLoader (in-process loading, ``shuffle=True``, a generator seeded with the
trial's seed) draws, for each epoch, a base seed, then its RandomSampler's permutation, and one
more permutation when the epoch's iterator is exhausted. :class:`LoaderOrder` draws the same, so
the data kept on the device (:mod:`tasks.jobs.resident`) and a packed trial
(:mod:`tasks.jobproc.packed`) train on the same batches as the loader would: same seed, same
model, whichever path. torch is imported when an order is made (the core stays light).
"""

from __future__ import annotations

from typing import Any


class LoaderOrder:
    """Each epoch's sample order of ``samples`` samples, as ``train``'s loader draws it from ``seed``."""

    def __init__(self, seed: int, samples: int) -> None:
        import torch

        self.samples = samples
        self._torch = torch
        self._generator = torch.Generator().manual_seed(seed)

    def next_epoch(self) -> Any:
        """The next epoch's order (a CPU ``torch.Tensor`` of sample indices)."""
        torch = self._torch
        torch.empty((), dtype=torch.int64).random_(generator=self._generator)
        order = torch.randperm(self.samples, generator=self._generator)
        torch.randperm(self.samples, generator=self._generator)
        return order
