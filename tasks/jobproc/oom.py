"""Device faults: a job that runs out of memory gives an entry that says so.

:func:`run_guarded` runs a job in its job process; on ``torch.OutOfMemoryError`` it records the
memory figures, releases what it can (``torch.cuda.empty_cache``) and, where the job's options
ask for it (``fallback="cpu"``, :class:`~tasks.core.records.JobOptions`, sent beside the kwargs),
runs the job again on the CPU in the same process. Otherwise it raises
:class:`~tasks.core.errors.OutOfMemory`, which becomes the device's error entry. When CUDA memory
is still held after the release, the job process says so and the worker retires it (a fresh one
takes the next job); the worker itself never held that memory. :func:`settle_device` does the
same after every job on CUDA: what the job left allocated (tensors in a module global) past
``MAX_GPU_MEMORY_LEFT_MIB``, or a CUDA error while releasing it, retires the process.
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


def warm_cublas(torch_device: str) -> None:
    """A tiny matmul forward and backward on ``torch_device``: the process's CUDA context made,
    cuBLAS loaded, and its workspaces made (one per handle: this thread's and autograd's). They
    are the process's, not a job's; :func:`release_memory` frees the workspaces again."""
    import torch

    warm = torch.ones(8, 8, device=torch_device, requires_grad=True)
    (warm @ warm).sum().backward()


def release_memory(torch_device: str, baseline: int = 0) -> bool:
    """Free cached device memory; True when more than ``baseline`` bytes are still allocated."""
    import gc

    gc.collect()
    if not torch_device.startswith("cuda"):
        return False
    import torch

    if torch.cuda.is_initialized():
        # Kernels run asynchronously: a device-side assert of the job's surfaces here, not in
        # the next job (raised to the caller: settle_device turns it into the job's error).
        torch.cuda.synchronize()
        # cuBLAS's workspaces (one per handle and stream, made by the job's first matmuls) are
        # allocated through the caching allocator, and empty_cache() keeps them: tens of MiB
        # the next job would find allocated. torch's own tests free them this way (private).
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
    torch.cuda.empty_cache()
    return bool(torch.cuda.memory_allocated() > baseline)


def leftover(allocated_bytes: int, limit_bytes: int) -> str | None:
    """Why a process whose CUDA allocator still holds ``allocated_bytes`` after its job must
    retire (over ``limit_bytes``), or None: a job's tensors kept in a module global would take
    that memory from every later job on the device."""
    if allocated_bytes <= limit_bytes:
        return None
    return (f"{allocated_bytes / MiB:,.0f} MiB of device memory still allocated after the job "
            f"(over {limit_bytes / MiB:,.0f} MiB: tensors it kept, e.g. in a module global)")


@dataclasses.dataclass(frozen=True)
class DeviceAfterJob:
    """The job's device once its memory was released (:func:`settle_device`)."""

    #: Bytes CUDA's caching allocator still reserves; None without CUDA (or when unreadable).
    reserved_bytes: int | None = None
    #: Why the process must not run another job; None: it may.
    retire: str | None = None
    #: What releasing or reading the memory raised (a CUDA error of the job's, reported late).
    error: Exception | None = None


def _cuda_memory() -> tuple[int, int] | None:
    """(allocated, reserved) bytes of this process's CUDA allocator; None when this process
    never initialised CUDA (asking would create a context)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())


def settle_device(torch_device: str, *, failed: bool, limit_bytes: int,
                  release: Callable[[str], bool] = release_memory,
                  measure: Callable[[], tuple[int, int] | None] = _cuda_memory) -> DeviceAfterJob:
    """Release what a job left on ``torch_device`` and say whether its process may run another.

    On CUDA after every job (else only after a failed one: its tensors are garbage then), the
    garbage is collected and the allocator's cache emptied; more than ``limit_bytes`` still
    allocated retires the process. An error while doing so (a device-side assert surfaces at
    the next synchronising call: pytorch#2300) never escapes: it is returned, and the process
    retires, since its context may be poisoned. Never raises.
    """
    cuda = torch_device.startswith("cuda")
    try:
        if cuda or failed:
            release(torch_device)
        figures = measure() if cuda else None
    except Exception as exc:  # whatever CUDA raises on a poisoned context
        return DeviceAfterJob(retire=f"CUDA error while releasing the job's device memory, the context may be "
                              f"poisoned: {type(exc).__name__}: {exc}", error=exc)
    if figures is None:
        return DeviceAfterJob()
    allocated, reserved = figures
    return DeviceAfterJob(reserved_bytes=reserved, retire=leftover(allocated, limit_bytes))


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
