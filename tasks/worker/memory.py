"""What a running job's processes use of their slot's memory budget, as the worker measures it.

A slot's budget (:mod:`tasks.worker.slots`) is enforced twice. The job process caps CUDA's
caching allocator below it before the job runs (``allocator_limit_bytes`` of
:class:`~tasks.core.wire.RunJob`), so a job that asks for too much gets torch's out-of-memory
error in its own process. And the supervisor measures what the job's whole process tree really
holds, every :data:`~tasks.core.defaults.MEMORY_SAMPLE_S`, with a :class:`MemoryMeter`, and ends a job past its budget
(``OutOfMemory``, with the figures) before it can take its neighbours' memory: memory the
allocator does not see (the CUDA context, cuBLAS workspaces, another library's allocations, a
command's own processes) counts too.

- :class:`DeviceMeter`: GPU memory per process from NVML (``nvidia-ml-py``), the job process
  and every process it started. NVML reports host PIDs: inside a container with its own PID
  namespace it finds none of them, and only the allocator's cap holds (the worker says so).
- :class:`ResidentMeter`: resident memory of the job process and its descendants (psutil),
  the budget of a slot on a CPU device. Sampled as the sum of their RSS (cheap, about 10 us a
  process); only when that sum is past the budget is it measured exactly, as the sum of their
  PSS (``/proc/<pid>/smaps_rollup``, about 1 ms a process), which counts the pages they share
  (torch's libraries, a forked DataLoader worker's copy-on-write pages) once, not once a process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import psutil

logger = logging.getLogger(__name__)

MiB = 1 << 20


class MemoryMeter(Protocol):
    """Measures a job process tree's memory."""

    #: ``"device"`` or ``"resident"``: what is measured (:attr:`WorkerRecord.memory_kind`).
    kind: str

    def used(self, pid: int) -> int | None:
        """Bytes the process ``pid`` and its descendants hold (a quick figure, never below the
        exact one); None when it cannot be measured."""

    def exact(self, pid: int) -> int | None:
        """The exact figure of :meth:`used`, asked only when the quick one is past a budget."""


def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and every live descendant (empty when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class ResidentMeter:
    """Resident memory of a job process and everything it started (DataLoader workers, a
    command and its children)."""

    kind = "resident"

    def used(self, pid: int) -> int | None:
        """The sum of the tree's RSS (shared pages counted in every process that maps them)."""
        return _sum_over_tree(pid, lambda process: process.memory_info().rss)

    def exact(self, pid: int) -> int | None:
        """The sum of the tree's PSS: each shared page split between the processes sharing it."""
        return _sum_over_tree(pid, lambda process: process.memory_full_info().pss)


def _sum_over_tree(pid: int, figure: Callable[[psutil.Process], int]) -> int | None:
    total, seen = 0, False
    for process in process_tree(pid):
        try:
            total += figure(process)
            seen = True
        except (psutil.Error, AttributeError):  # ended between the listing and the read; no PSS
            continue
    return total if seen else None


class DeviceMeter:
    """GPU memory held by a job process and its descendants, from NVML."""

    kind = "device"

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, uuid: str | None, index: int) -> DeviceMeter:
        """The meter of the GPU ``uuid`` (else NVML's ``index``).

        Raises:
            ImportError: ``nvidia-ml-py`` is not installed.
            Exception: NVML's error (no driver, no such GPU).
        """
        import pynvml

        pynvml.nvmlInit()
        if uuid:
            try:
                return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid))
            except pynvml.NVMLError as exc:  # a UUID in another spelling: NVML's index order then
                logger.warning("NVML does not know GPU %s (%s); measuring NVML's GPU %d", uuid, exc, index)
        return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))

    def used(self, pid: int) -> int | None:
        pids = {process.pid for process in process_tree(pid)}
        if not pids:
            return None
        try:
            running = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception as exc:  # noqa: BLE001  (NVML's errors are its own classes)
            logger.debug("NVML could not list the GPU's processes: %s", exc)
            return None
        return sum(int(p.usedGpuMemory or 0) for p in running if p.pid in pids)

    def exact(self, pid: int) -> int | None:
        return self.used(pid)


def open_meter(kind: str, uuid: str | None, index: int, label: str) -> MemoryMeter | None:
    """The meter of a device of ``kind`` (``"gpu"``: NVML; else resident memory); None when a
    GPU's memory cannot be measured here (the reason is logged: only the allocator's cap holds)."""
    if kind != "gpu":
        return ResidentMeter()
    try:
        return DeviceMeter.open(uuid, index)
    except ImportError:
        why = "nvidia-ml-py is not installed"
    except Exception as exc:  # noqa: BLE001  (NVMLError_*: no driver, no such GPU)
        why = f"NVML: {exc}"
    logger.warning("%s: slot memory budgets are held by the CUDA allocator's cap only (%s); the "
                   "worker cannot measure its job processes' GPU memory", label, why)
    return None


def figures(used: int, budget: int, kind: str, slot: int) -> dict[str, Any]:
    """The memory figures of a job ended past its budget (its ``OutOfMemory`` entry's ``memory``)."""
    return {"measured": kind, "used_mib": round(used / MiB, 1), "budget_mib": round(budget / MiB, 1),
            "slot": slot}
