"""A device's slots: the jobs it runs at once, each with its cores and its memory budget.

A worker config's ``slots = N`` gives the device N slots. The Celery worker then runs N jobs at
once (its thread pool's concurrency, and N prefetched messages); each job takes a free slot for
its run (:meth:`Slots.take`) and runs in a job process of its own (the supervisor keeps N + 1
warm), pinned to the slot's cores with the slot's torch threads, and watched against the slot's
memory budget (:mod:`tasks.worker.memory`).

- Cores: the worker's cores split into N contiguous runs (sizes differ by at most one); with
  fewer cores than slots, slots share cores round-robin.
- Budget: ``memory_gib`` per slot, else the device's memory split N ways (the GPU's memory on a
  GPU worker, the host's RAM on a CPU worker).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Bytes in a GiB (``memory_gib``).
GiB = 1 << 30


@dataclass(frozen=True)
class Slot:
    """One slot: where a job runs and how much memory it may use."""

    index: int
    cores: list[int]
    #: ``torch.set_num_threads`` of a job in this slot.
    threads: int
    #: Bytes a job in this slot may use; None: not enforced.
    budget_bytes: int | None


def split_cores(cores: list[int], slots: int) -> list[list[int]]:
    """``cores`` split into ``slots`` contiguous runs whose sizes differ by at most one; with
    fewer cores than slots, each slot gets one core, shared round-robin."""
    if slots < 1:
        raise ValueError(f"slots={slots}: a device has at least one slot")
    if not cores:
        return [[] for _ in range(slots)]
    if len(cores) < slots:
        return [[cores[i % len(cores)]] for i in range(slots)]
    size, extra = divmod(len(cores), slots)
    runs, start = [], 0
    for i in range(slots):
        end = start + size + (1 if i < extra else 0)
        runs.append(cores[start:end])
        start = end
    return runs


def plan_slots(cores: list[int], slots: int, torch_threads: int | None, memory_gib: float | None,
               device_memory_bytes: int | None) -> list[Slot]:
    """The slots of a device: their cores, threads (``torch_threads`` each, else one per core of
    the slot) and budgets (``memory_gib`` each, else ``device_memory_bytes`` split ``slots`` ways;
    None when neither is known)."""
    if memory_gib is not None:
        budget: int | None = int(memory_gib * GiB)
    elif device_memory_bytes:
        budget = device_memory_bytes // slots
    else:
        budget = None
    return [Slot(index=i, cores=run, threads=torch_threads or max(1, len(run)), budget_bytes=budget)
            for i, run in enumerate(split_cores(cores, slots))]


class Slots:
    """The slots of one device worker, and which of them run a job now (thread-safe)."""

    def __init__(self, slots: list[Slot]) -> None:
        if not slots:
            raise ValueError("a device has at least one slot")
        self.all = list(slots)
        self._free = list(range(len(slots)))
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self.all)

    @property
    def busy(self) -> int:
        """How many slots run a job now."""
        with self._cond:
            return len(self.all) - len(self._free)

    @contextmanager
    def take(self) -> Iterator[Slot]:
        """Hold the lowest free slot for one job's run (waits while every slot is busy, which
        the worker's concurrency, equal to the slot count, never lets happen for long)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            index = min(self._free)
            self._free.remove(index)
        try:
            yield self.all[index]
        finally:
            with self._cond:
                self._free.append(index)
                self._cond.notify()
