"""Device faults: a job that runs out of memory gives an entry that says so.

:func:`run_guarded` runs a job in its job process; on ``torch.OutOfMemoryError`` it records the
memory figures, releases what it can (``torch.cuda.empty_cache``) and, where the job's options
ask for it (``fallback="cpu"``, :class:`~tasks.core.records.JobOptions`, sent beside the kwargs),
runs the job again on the CPU in the same process. Otherwise it raises
:class:`~tasks.core.errors.OutOfMemory`, which becomes the device's error entry. When CUDA memory
is still held after the release, the job process says so and the worker retires it (a fresh one
takes the next job); the worker itself never held that memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import psutil

from ..core.errors import OutOfMemory
from ..core.job import JobContext

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


def memory_figures(torch_device: str) -> dict[str, Any]:
    """Memory figures of ``torch_device`` (CUDA: allocated/reserved/total MiB) and of the process."""
    figures: dict[str, Any] = {"device": torch_device,
                               "process_rss_mib": round(psutil.Process().memory_info().rss / MiB, 1)}
    if torch_device.startswith("cuda"):
        import torch

        figures.update(
            allocated_mib=round(torch.cuda.memory_allocated() / MiB, 1),
            reserved_mib=round(torch.cuda.memory_reserved() / MiB, 1),
            total_mib=round(torch.cuda.get_device_properties(0).total_memory / MiB, 1),
        )
    return figures


def _oom_error() -> type[BaseException]:
    """torch's out-of-memory error (``torch.OutOfMemoryError`` since 2.5, a CUDA one before)."""
    import torch

    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _allocated(torch_device: str) -> int:
    if not torch_device.startswith("cuda"):
        return 0
    import torch

    return int(torch.cuda.memory_allocated())


def release_memory(torch_device: str, baseline: int = 0) -> bool:
    """Free cached device memory; True when more than ``baseline`` bytes are still allocated."""
    import gc

    gc.collect()
    if not torch_device.startswith("cuda"):
        return False
    import torch

    torch.cuda.empty_cache()
    return bool(torch.cuda.memory_allocated() > baseline)


def run_guarded(
    func: Callable[[JobContext, Any], dict[str, Any]], ctx: JobContext, params: Any,
    fallback: str | None,
) -> tuple[dict[str, Any], bool]:
    """Run ``func(ctx, params)``, handling out-of-memory; returns (output, recycle_worker).

    Raises:
        OutOfMemory: the job ran out of memory and asked for no fallback (or the fallback did too).
    """
    oom_error = _oom_error()
    baseline = _allocated(ctx.torch_device)
    try:
        return func(ctx, params), False
    except oom_error:
        before = memory_figures(ctx.torch_device)
    # Out of the except block: the exception and its traceback, which hold the job's tensors,
    # are gone, so the release below can free them.
    still_held = release_memory(ctx.torch_device, baseline)
    logger.warning("%s: out of memory in job %s (%s)", ctx.device, ctx.job_id, before)
    if fallback != "cpu":
        raise OutOfMemory(
            f"job ran out of memory on {ctx.device} ({ctx.torch_device}): {before}; "
            "use a smaller batch or model, or send it with the option fallback='cpu' to run it on the CPU instead",
            memory=before, recycle=still_held,
        )
    cpu_ctx = dataclasses.replace(ctx, torch_device="cpu", fallback_from=ctx.torch_device)
    try:
        output = func(cpu_ctx, params)
    except oom_error:
        raise OutOfMemory(
            f"job ran out of memory on {ctx.device} ({ctx.torch_device}): {before}, and again on "
            f"the CPU fallback: {memory_figures('cpu')}",
            memory=before, recycle=still_held,
        ) from None
    output = {**output, "fallback": {"from": ctx.torch_device, "to": "cpu", "memory": before}}
    return output, still_held
