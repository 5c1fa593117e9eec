"""The owner of a device's job processes: one runs the job, a spare waits, a thread spawns.

A device worker never runs a job itself. :class:`Supervisor` keeps its job processes
(:mod:`tasks.worker.jobprocess`) warm (its pool: :class:`~tasks.worker.pool.ProcessPool`), hands
each running job to one of them (:meth:`Supervisor.run`, a pack's trials
:meth:`Supervisor.run_pack`) and watches it to its end (:class:`~tasks.worker.runloop.RunLoop`).

A process is retired (ended, and a fresh one spawned in the background while the spare takes
the next job) after a crash or a kill, when it says so itself (a CUDA error that may have
poisoned its context, an out-of-memory, a job that raised SystemExit), when it grew past the memory
threshold, after ``jobs_per_process`` jobs, or after a device group's job that left processes
behind (they end with it, before the group's devices run anything else). Otherwise it runs the next job too, from the
environment and working directory it started with (:mod:`tasks.jobproc.runtime`).

Job processes are started by :func:`tasks.core.children.spawn_child`: each leads its own process
group and gets SIGKILL from the kernel when its worker dies, however the worker dies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from ..core.defaults import SPARE_PROCESSES
from ..core.wire import RunJob, RunPack
from . import owners
from .jobprocess import JobProcess
from .memory import MemoryMeter
from .pool import ProcessPolicy, ProcessPool
from .runloop import Budget, Ended, Refill, RunLoop, Watch, WatchOver
from .slots import Slot

__all__ = ["SPARE_PROCESSES", "Apart", "Ended", "ProcessPolicy", "Refill", "Supervisor", "Watch", "WatchOver"]


@dataclass(frozen=True)
class Apart:
    """A job that runs in a process of its own (:meth:`Supervisor.run`): a device group's whose
    visibility this device's processes lack (CUDA reads it once, at a process's start)."""

    #: Over the device's environment (the group's ``CUDA_VISIBLE_DEVICES``).
    env: dict[str, str]
    #: The group's memory budget (its devices' together), where this device measures memory.
    budget_bytes: int | None = None


class Supervisor(ProcessPool):
    """The job processes of one device worker (its pool) and the doors that run a job or a
    pack of trials in one of them (one :class:`~tasks.worker.runloop.RunLoop` each)."""

    #: Measures a running job's memory against its slot's budget (set by the device worker
    #: once the first process said what the device is); None: not measured.
    meter: MemoryMeter | None = None

    def run(self, job: RunJob, watch: Watch, slot: Slot | None = None, apart: Apart | None = None) -> Ended:
        """Run ``job`` and watch it to its end: in a ready job process of this device (in
        ``slot``: on its cores, within its memory budget), or, with ``apart``, in a process of
        its own (:class:`Apart`: a GPU group's job, which must see all its GPUs).

        Raises:
            NoJobProcess: none became ready within the start timeout.
        """
        if apart is not None:
            return self._run_apart(job, watch, apart)
        process = self._take(owners.owner_of(job))
        ends: dict[str, Ended] = {}
        loop = self._loop(process, [job], {job.job_id: watch}, slot, ends.__setitem__)
        cpu_before = _cpu_seconds(process.pid)
        last, retire = loop.wait()
        ended, cpu_after = ends[job.job_id], _cpu_seconds(process.pid)
        if cpu_before is not None and cpu_after is not None and cpu_after >= cpu_before:
            # The seconds it kept its cores busy: what `devicefleet usage` says of a CPU device (tasks.ops.usage).
            cores = len(loop.leader.cores or self.spec.cores)
            ended = dataclasses.replace(ended, busy_s=(cpu_after - cpu_before) / max(1, cores))
        retire = retire or self._retire_reason(process, last)
        if retire is None and job.devices is not None and _has_children(process.pid):
            # A group's job may have started processes over all its devices (a launcher's, or
            # mp.spawn's): any left end with this process's group, before the devices run other jobs.
            retire = "a device group's job left processes behind: they end with it"
        self._give_back(process, retire)
        return ended if retire == ended.retired else dataclasses.replace(ended, retired=retire)

    def run_pack(self, pack: RunPack, watches: Mapping[str, Watch], slot: Slot,
                 on_end: Callable[[str, Ended], None], refill: Refill | None = None) -> None:
        """Run ``pack`` (several trials of one job, trained at once: :mod:`tasks.worker.pack`)
        in one ready job process, in ``slot``, each member watched by its watch of ``watches``
        and its one ending handed to ``on_end(job_id, ended)`` as soon as the process ends it
        (how a pack's members stop, end and are refilled from ``refill``: :class:`~tasks.worker.runloop.RunLoop`).

        Raises:
            NoJobProcess: none became ready within the start timeout (no member was ended).
        """
        process = self._take(owners.pack_owner(pack.members))
        last, retire = self._loop(process, pack.members, watches, slot, on_end, refill, packed=True).wait()
        self._give_back(process, retire or self._retire_reason(process, last))

    def needs_own_process(self, env: dict[str, str]) -> bool:
        """Whether a job whose process must see ``env`` (a device group's visibility) cannot run
        in one of this device's processes: CUDA reads its visibility once, at its start."""
        return any(self._env.get(name) != value for name, value in env.items())

    def _loop(self, process: JobProcess, members: list[RunJob], watches: Mapping[str, Watch], slot: Slot | None,
              on_end: Callable[[str, Ended], None], refill: Refill | None = None, packed: bool = False) -> RunLoop:
        """The run loop of ``members`` in ``process``, placed in ``slot`` (its cores, its threads,
        its allocator's cap: a group's job comes with its devices' cores) and measured against its
        budget (a group's slot carries the sum of its devices': :mod:`tasks.core.groups`)."""
        if slot is not None and members[0].devices is None:
            placed = self._placed(slot, process)
            members = [member.model_copy(update=placed) for member in members]
        budget = None
        if slot is not None and slot.budget_bytes is not None and self.meter is not None:
            budget = Budget(slot, self.meter)
        return RunLoop(process, members, watches, self.policy.cancel_grace_s, budget, on_end, packed, refill)

    def _run_apart(self, job: RunJob, watch: Watch, apart: Apart) -> Ended:
        """Run ``job`` in a process of its own (:class:`Apart`), pinned to ``job.cores``, and
        end that process after it (:meth:`~tasks.worker.pool.ProcessPool._take_apart`).

        Raises:
            NoJobProcess: it did not become ready within the start timeout.
        """
        cores = sorted(job.cores or self.spec.cores)
        threads = job.torch_threads or len(cores)
        process = self._take_apart(owners.owner_of(job), cores, threads, apart.env)
        try:
            budget = None
            if apart.budget_bytes is not None and self.meter is not None:
                slot = Slot(index=job.slot or 0, cores=cores, threads=threads, budget_bytes=apart.budget_bytes)
                budget = Budget(slot, self.meter)
            ends: dict[str, Ended] = {}
            RunLoop(process, [job], {job.job_id: watch}, self.policy.cancel_grace_s, budget, ends.__setitem__).wait()
            return ends[job.job_id]
        finally:
            self._give_back(process, "its group's job ended")

    def _placed(self, slot: Slot, process: JobProcess) -> dict[str, Any]:
        """A job's place in ``slot`` (:data:`~tasks.worker.runloop.PLACED`): its cores and threads;
        on a GPU, its allocator capped at the slot's budget less what the process held on the
        device before it (its CUDA context)."""
        limit = None
        if slot.budget_bytes is not None and self.spec.torch_device.startswith("cuda"):
            held = 0
            if self.meter is not None and self.meter.kind == "device":
                if process.device_baseline is None:
                    process.device_baseline = self.meter.used(process.pid) or 0
                held = process.device_baseline
            limit = max(0, slot.budget_bytes - held)
        return {"slot": slot.index, "cores": slot.cores, "torch_threads": slot.threads, "allocator_limit_bytes": limit}


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` and its reaped children used so far (None: it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system + times.children_user + times.children_system)


def _has_children(pid: int) -> bool:
    """Whether process ``pid`` has a child (a job's leftover: the job process itself starts none
    between jobs)."""
    try:
        return bool(psutil.Process(pid).children())
    except psutil.Error:
        return False

