"""Data that lives on the device: a dataset put on the job's device once, its batches indexed there.

A small dataset (digits: 1,797 x 64 floats) costs a DataLoader more than it costs the model: every
batch is collated by a worker, handed over through shared memory, pinned and copied to the GPU,
and the loop waits for it. When the whole dataset fits in the job's memory budget it can instead
be copied to the device once; each epoch draws one permutation there
(``torch.randperm(..., device=..., generator=...)``) and each batch is an ``index_select`` of the
device tensors: no worker, no host-to-device copy, no host sync per step. When it does not fit,
the loader path (:mod:`.loader`: pinned, prefetched) stays.

The API, for ``train`` and for a user's own job::

    from tasks import DeviceData, place_data

    placement = place_data(ctx, x, y)               # fits its budget? (and why, in words)
    if placement.on_device:
        data = DeviceData.from_tensors(x, y, device=ctx.torch_device)
        for epoch in range(epochs):
            for xb, yb in data.batches(64, data.generator(seed + epoch)):
                ...

:func:`decide` is the pure rule behind :func:`place_data`; ``DeviceData.batches(..., rank=,
world_size=)`` gives a rank of a distributed job its shard, the way ``DistributedSampler`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.defaults import RESIDENT_DATA_FRACTION
from ..core.errors import DatasetError
from ..core.job import JobContext

MiB = 1024 * 1024

#: ``auto``: on the device when it fits, else the loader; ``device``/``loader``: that path.
DataMode = Literal["auto", "device", "loader"]


@dataclass(frozen=True)
class Placement:
    """Where a job's dataset lives while it trains, and why (``train``'s ``data_path`` output)."""

    #: ``device``: put on the job's device once, batches indexed there; ``loader``: a DataLoader.
    path: Literal["device", "loader"]
    #: Bytes of the dataset's tensors.
    data_bytes: int
    #: The most the dataset may take there (``RESIDENT_DATA_FRACTION`` of the budget); None: no cap.
    limit_bytes: int | None
    #: Why, in words.
    note: str

    @property
    def on_device(self) -> bool:
        return self.path == "device"


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes the tensors' elements take."""
    return sum(t.numel() * t.element_size() for t in tensors)


def decide(data_bytes: int, torch_device: str, budget_bytes: int | None, mode: DataMode = "auto", *,
           fraction: float = RESIDENT_DATA_FRACTION) -> Placement:
    """Where a dataset of ``data_bytes`` lives for a job on ``torch_device`` with ``budget_bytes``.

    It goes on the device when ``mode`` is ``device``, or ``auto`` and it takes at most
    ``fraction`` of the budget (the rest is the model's, its gradients' and activations'); with
    no budget (a CPU slot without one, a GPU with no allocator cap) it fits: on a CPU the
    tensors are in the process's memory already, on a GPU the caller passes the free memory.

    Raises:
        DatasetError: ``mode`` is ``device`` and the dataset is larger than the budget itself.
    """
    limit = None if budget_bytes is None else int(budget_bytes * fraction)
    size = f"{data_bytes / MiB:,.1f} MiB"
    where = f"{torch_device}'s budget of {budget_bytes / MiB:,.0f} MiB" if budget_bytes is not None else torch_device
    if mode == "loader":
        return Placement("loader", data_bytes, limit, f"data=loader: a DataLoader feeds the {size} dataset")
    if mode == "device":
        if budget_bytes is not None and data_bytes > budget_bytes:
            raise DatasetError(
                f"data='device': the dataset's {size} do not fit {where}; send data='auto' or "
                "'loader' to feed it through a DataLoader, or give the job a larger memory budget")
        return Placement("device", data_bytes, limit, f"data=device: the {size} dataset lives on {torch_device}")
    if limit is None or data_bytes <= limit:
        cap = "" if limit is None else f" (at most {fraction:.0%} of {where})"
        return Placement("device", data_bytes, limit,
                         f"the {size} dataset fits{cap}: it lives on {torch_device}, batches indexed there")
    return Placement("loader", data_bytes, limit,
                     f"the {size} dataset is over {fraction:.0%} of {where}: a DataLoader feeds it")


def place_data(ctx: JobContext, *tensors: torch.Tensor, mode: DataMode = "auto") -> Placement:
    """:func:`decide` for a job's tensors, against its memory budget (``ctx.memory_budget_bytes``;
    on a GPU without one, the device's free memory)."""
    budget = ctx.memory_budget_bytes
    if budget is None and ctx.torch_device.startswith("cuda") and torch.cuda.is_available():
        budget = int(torch.cuda.mem_get_info(torch.device(ctx.torch_device))[0])
    return decide(tensor_bytes(*tensors), ctx.torch_device, budget, mode)


class DeviceData:
    """Tensors of equal length on one device, yielding shuffled batches indexed there."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise DatasetError(f"DeviceData needs tensors of equal length, got {[len(t) for t in tensors]}")
        self.tensors = tensors
        self.device = tensors[0].device

    @classmethod
    def from_tensors(cls, *tensors: torch.Tensor, device: str | torch.device) -> DeviceData:
        """Copy ``tensors`` to ``device`` once (no copy when they are there already)."""
        return cls(tuple(t.to(device) for t in tensors))

    def __len__(self) -> int:
        return len(self.tensors[0])

    @property
    def nbytes(self) -> int:
        return tensor_bytes(*self.tensors)

    def generator(self, seed: int) -> torch.Generator:
        """A generator on this data's device seeded with ``seed``: one per epoch
        (``seed + epoch``) gives the same order after a resume as in an unbroken run."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def shard_size(self, world_size: int = 1) -> int:
        """Samples each of ``world_size`` ranks sees per epoch (``DistributedSampler``'s: padded up)."""
        return math.ceil(len(self) / world_size)

    def batches(self, batch_size: int, generator: torch.Generator | None = None, *, shuffle: bool = True,
                rank: int = 0, world_size: int = 1, order: torch.Tensor | None = None,
                ) -> Iterator[tuple[torch.Tensor, ...]]:
        """One epoch of batches of ``batch_size`` (the last may be smaller), as device tensors.

        Shuffled by one permutation drawn from ``generator`` (on its device: the data's own by
        default; pass equal ones on every rank), or in the given ``order`` (a permutation, e.g.
        :class:`~tasks.core.batch_order.LoaderOrder`'s); rank ``rank`` of ``world_size`` takes every ``world_size``-th
        sample of it, the order padded by wrapping around so every rank has :meth:`shard_size`
        samples, as ``DistributedSampler`` does (with a CPU generator seeded ``seed + epoch``,
        the very order it gives).
        """
        n = len(self)
        if order is not None:
            order = order.to(self.device, non_blocking=True)
        elif shuffle:
            gen_device = generator.device if generator is not None else self.device
            order = torch.randperm(n, device=gen_device, generator=generator).to(self.device, non_blocking=True)
        else:
            order = torch.arange(n, device=self.device)
        if world_size > 1:
            total = self.shard_size(world_size) * world_size
            if total > n:
                order = order.repeat(math.ceil(total / n))[:total]
            order = order[rank:total:world_size]
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            yield tuple(t.index_select(0, index) for t in self.tensors)
