"""The fed-device benchmark's workload, shared by its feeders (:mod:`.pipeline`, :mod:`.ray_pipeline`).

Each batch takes ``latency_s`` of waiting (standing in for disk or network), then computes a
``(4, elements, 3)`` float32 array with ``(4, 1)`` labels; each train step takes ``step_s``. What
is measured is how long the step waits for its next batch: a producer/consumer prefetch
pipeline with enough producers hides the latency, a sequential loop pays all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Workload:
    """``latency_s`` wait per batch, a ``step_s`` train step, ``producers`` feeding in parallel."""

    latency_s: float = 0.5
    step_s: float = 0.1
    elements: int = 1_000_000
    batches: int = 60
    warmup: int = 10
    producers: int = 8


def make_batch(index: int, work: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch: wait ``latency_s``, then compute a ``(4, elements, 3)`` float32 array."""
    time.sleep(work.latency_s)
    generator = torch.Generator().manual_seed(index)
    x = torch.rand((4, work.elements, 3), generator=generator)
    y = torch.randint(0, 2, (4, 1), generator=generator)
    return x, y


def consume(batches: Iterable[Any], total: int, warmup: int, step_s: float,
            to_device: Callable[[Any], Any] | None = None) -> float:
    """Mean seconds waited for the next batch, over the batches after ``warmup``.

    Takes ``total`` batches from ``batches``; after each, sleeps ``step_s`` (the fake train step).
    """
    waits: list[float] = []
    iterator = iter(batches)
    for i in range(total):
        t0 = time.perf_counter()
        batch = next(iterator)
        if to_device is not None:
            batch = to_device(batch)
        if i >= warmup:
            waits.append(time.perf_counter() - t0)
        time.sleep(step_s)  # the fake train step
    return sum(waits) / len(waits)
