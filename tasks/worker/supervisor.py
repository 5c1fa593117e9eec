"""The owner of a device's job processes: one runs the job, a spare waits, a thread spawns.

A device worker never runs a job itself. :class:`Supervisor` keeps one job process
(:mod:`tasks.worker.jobprocess`) per slot alive and ready (torch and the job modules imported),
and a spare, hands each running job to one of them (:meth:`Supervisor.run`) and watches it:

- a report, a batch of a command's log lines, a rank's store port or its own failure is handed
  to the job's :class:`Watch` (which relays it to Redis: the job process has no door to it);
- a stop the watch asks for (a cancel, the time limit, the worker's stop) is sent to the job,
  which raises at its next ``ctx.progress()``; a job that has not ended ``cancel_grace_s`` later
  has its process group ended (SIGTERM, then SIGKILL) and its entry says why;
- a process that dies ends its job as ``JobCrashed``, naming the signal or exit status and the
  job's last lines;
- a job whose processes hold more memory than its slot's budget (sampled every
  :data:`~tasks.core.defaults.MEMORY_SAMPLE_S` by a :class:`~tasks.worker.memory.MemoryMeter`) has its
  process group ended at once, as ``OutOfMemory`` with the figures: its slot's neighbours keep
  theirs.

A process is retired (ended, and a fresh one spawned in the background while the spare takes
the next job) after a crash or a kill, when it says so itself (a CUDA error that may have
poisoned its context, an out-of-memory, a job that raised SystemExit), when it grew past the memory
threshold, after ``jobs_per_process`` jobs, or after a device group's job that left processes
behind (they end with it, before the group's devices run anything else). Otherwise it runs the next job too, from the
environment and working directory it started with (:mod:`tasks.jobproc.runtime`).

A process belongs to the user of the first job it runs and never runs another user's
(:mod:`tasks.worker.owners`): a job takes a warm process of its own user, else the unowned spare,
and a fresh spare is spawned in the background. Up to ``kept_user_processes`` idle processes of
other users stay warm beyond the slots and spares (users who alternate each find theirs); past
that, the least recently used is retired to make room for the spare. Under job accounts
(:mod:`tasks.core.accounts`) each process starts as its user's system account, so it is that
user's from its start: a job of a user with no process waits for one started for them, and the
spare is the last user's (:func:`owners.plan_accounts_spawn`).

Job processes are started by :func:`tasks.core.children.spawn_child`: each leads its own process
group and gets SIGKILL from the kernel when its worker dies, however the worker dies.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from ..core.accounts import JobAccount, JobAccounts
from ..core.defaults import (
    CANCEL_GRACE_S,
    KEPT_USER_PROCESSES,
    MEMORY_SAMPLE_S,
    PROCESS_START_TIMEOUT_S,
    RESPAWN_BACKOFF_S,
    SPARE_PROCESSES,
    SUPERVISOR_JOIN_S,
)
from ..core.defaults import JOB_POLL_S as POLL_S
from ..core.errors import JobCrashed, NoJobAccount, NoJobProcess, OutOfMemory, WorkerStopped
from ..core.priority import Level
from ..core.records import ErrorInfo
from ..core.settings import TENSORBOARD_SUBDIR
from ..core.wire import (
    STOPS,
    Finished,
    Hello,
    LogLines,
    ModeMessage,
    NewMember,
    Outcome,
    Proceed,
    ProcessSpec,
    Report,
    RunJob,
    RunPack,
    StopJob,
    StopReason,
    WantMember,
)
from . import memory, owners
from .group_host import GroupHostLink
from .jobprocess import JobProcess, ProcessGone
from .memory import MemoryMeter
from .slots import Slot

#: ``refill() -> (message, watch) | None``: the next waiting trial of a pack's queue, taken,
#: leased and watched as the pack's first members were; None: no more (:class:`_PackRun`).
Refill = Callable[[], "tuple[RunJob, Watch] | None"]

logger = logging.getLogger(__name__)




@dataclass(frozen=True)
class ProcessPolicy:
    """When job processes are retired, and how long a stopped job has."""

    #: Jobs one process runs before it is retired; 0: no limit.
    jobs_per_process: int = 0
    #: Retire a process whose resident memory grew by more than this since it was ready; 0: never.
    max_memory_growth_bytes: int = 0
    #: Seconds a job has to stop at ``ctx.progress()`` once asked, before its process is ended.
    cancel_grace_s: float = CANCEL_GRACE_S
    #: Seconds a new process has to import torch and the job modules and say hello.
    start_timeout_s: float = PROCESS_START_TIMEOUT_S
    #: Idle processes of other users kept warm beyond the slots and spares (:mod:`.owners`).
    kept_user_processes: int = KEPT_USER_PROCESSES


class Watch(Protocol):
    """What the supervisor asks of the job it runs (implemented by the runner)."""

    def report(self, fields: dict[str, Any]) -> None:
        """Publish a progress report."""

    def log(self, lines: Sequence[tuple[str, str]]) -> None:
        """Publish a batch of a command's output lines (``[stream, text]``)."""

    def heard(self, message: ModeMessage) -> Proceed | None:
        """A message of the job's run mode (:data:`~tasks.core.wire.ModeMessage`, a gang's): act
        on it and return the answer to send the job process, if any (a plain job sends none)."""

    def stop(self) -> StopJob | None:
        """Whether to stop the job now, and why (asked every :data:`POLL_S`). A question only:
        what acting on the stop takes is :meth:`act_on`'s."""

    def slot_stop(self) -> StopJob | None:
        """Of :meth:`stop`'s answers, those that ask the job's slot to make way rather than end the
        job for its own sake (a preemption, a drain's hand-back, the worker's stop): what a pack
        asks of its leader's watch once the leader's own trial has ended. A question only."""

    def act_on(self, stop: StopJob) -> StopJob | None:
        """The supervisor acts on ``stop`` (one :meth:`stop` gave) now: take what acting on it
        takes (a preemption claims the waiting message the job makes way for; a fenced job's
        reports are no longer relayed) and return the stop to send, or ``None`` where it no
        longer stands (the message went to another job: the job runs on)."""

    def memory(self, used: int) -> None:
        """The job's memory at its latest sample (bytes)."""

    def made_way(self, level: Level) -> None:
        """The job's gang makes way for ``level`` work as a whole, though its own worker did not
        ask it (the stop that follows says so too)."""


class WatchOver:
    """A watch that adds to another's (a gang's, a group's): every call goes to ``inner``
    unless a subclass says more."""

    def __init__(self, inner: Watch) -> None:
        self.inner = inner

    def report(self, fields: dict[str, Any]) -> None:
        self.inner.report(fields)

    def log(self, lines: Sequence[tuple[str, str]]) -> None:
        self.inner.log(lines)

    def heard(self, message: ModeMessage) -> Proceed | None:
        return self.inner.heard(message)

    def stop(self) -> StopJob | None:
        return self.inner.stop()

    def slot_stop(self) -> StopJob | None:
        return self.inner.slot_stop()

    def act_on(self, stop: StopJob) -> StopJob | None:
        return self.inner.act_on(stop)

    def memory(self, used: int) -> None:
        self.inner.memory(used)

    def made_way(self, level: Level) -> None:
        self.inner.made_way(level)


@dataclass(frozen=True)
class Apart:
    """A job that runs in a process of its own (:meth:`Supervisor.run`): a device group's whose
    visibility this device's processes lack (CUDA reads it once, at a process's start)."""

    #: Over the device's environment (the group's ``CUDA_VISIBLE_DEVICES``).
    env: dict[str, str]
    #: The group's memory budget (its devices' together), where this device measures memory.
    budget_bytes: int | None = None


@dataclass(frozen=True)
class Ended:
    """How a run ended, as the supervisor saw it: the value the runner matches on
    (:func:`tasks.worker.runner.settle`)."""

    outcome: Outcome
    #: The job process's own account; None when the process died or was ended.
    finished: Finished | None
    error: ErrorInfo | None
    #: The module of the error's exception type, where the job raised it.
    error_module: str | None
    pid: int
    #: Why its process was retired after this job; None: it runs the next one.
    retired: str | None
    #: The stop the worker sent the job (or ended it with before it ran); None: none was.
    stop: StopJob | None = None
    #: How many jobs ran at once in its process and slot (a pack's members): each counts
    #: 1/``shared_by`` of the time for the device's busy seconds and its user's fair share.
    shared_by: int = 1
    #: Seconds the job kept its cores busy (its process's CPU seconds over its cores), measured
    #: by the worker; None where not measured (its process died, a pack, a group apart).
    busy_s: float | None = None

    @property
    def crashed(self) -> bool:
        return self.error is not None and self.error.type == "JobCrashed"

    def under(self, stop: StopJob | None) -> Ended:
        """This ending with ``stop``, the stop the worker sent, and the outcome that stop makes
        of it: a job its worker fenced off ends ``fenced`` however its process ended (no result
        of the attempt may be stored), one asked to make way ends ``preempted`` unless it
        finished ok first; ``preempted`` is never a job's own saying (a job that raised
        ``Preempted`` unasked failed)."""
        outcome = self.outcome
        if stop is not None and stop.reason is StopReason.FENCED:
            outcome = Outcome.FENCED
        elif stop is not None and stop.reason is StopReason.PREEMPT:
            outcome = outcome if outcome is Outcome.OK else Outcome.PREEMPTED
        elif stop is not None and stop.reason is StopReason.DEVICE_FAILED:
            # However its process ended (a crash, likely, on a GPU gone): its device's failure.
            outcome = outcome if outcome is Outcome.OK else Outcome.DEVICE_FAILED
        elif outcome in (Outcome.PREEMPTED, Outcome.FENCED, Outcome.DEVICE_FAILED):
            outcome = Outcome.ERROR
        return dataclasses.replace(self, outcome=outcome, stop=stop)

    @classmethod
    def by_worker(cls, error: type[BaseException], message: str, pid: int, retired: str | None,
                  outcome: Outcome = Outcome.ERROR, figures: dict[str, Any] | None = None,
                  stop: StopJob | None = None) -> Ended:
        """A job the worker ended (or found ended), with one of devicefleet's job errors (and
        its memory ``figures`` when it ended past its budget; the ``stop`` it ended it for)."""
        return cls(outcome=outcome, finished=None,
                   error=ErrorInfo(type=error.__name__, message=message, memory=figures),
                   error_module=error.__module__, pid=pid, retired=retired, stop=stop)

    @classmethod
    def stopped(cls, stop: StopJob, message: str | None = None) -> Ended:
        """A job ended for ``stop`` before (or between) its runs: the error and outcome of
        :data:`~tasks.core.wire.STOPS` for its reason, the stop's message or ``message``."""
        error, outcome = STOPS[stop.reason]
        return cls.by_worker(error, message or stop.message, pid=0, retired=None, outcome=outcome, stop=stop)


class Supervisor:
    """The job processes of one device worker."""

    def __init__(self, spec: ProcessSpec, env: dict[str, str], cwd: Path, policy: ProcessPolicy,
                 label: str, slots: int = 1, accounts: JobAccounts | None = None) -> None:
        self.spec = spec
        #: Each user's jobs run as the user's own system account (:mod:`tasks.core.accounts`);
        #: None or empty: every job process runs as this worker.
        self.accounts = accounts if accounts else None
        self.policy = policy
        self.label = label
        #: Job processes kept alive: one per slot and the spares.
        self.warm = slots + SPARE_PROCESSES
        #: The most job processes alive at once: the warm ones and the other users' kept.
        self.most = self.warm + policy.kept_user_processes
        #: Measures a running job's memory against its slot's budget (set by the device worker
        #: once the first process said what the device is); None: not measured.
        self.meter: MemoryMeter | None = None
        self._env = env
        self._cwd = cwd
        self._cond = threading.Condition()
        self._idle: list[JobProcess] = []
        self._busy: set[JobProcess] = set()
        self._spawning = 0
        #: Under job accounts, whose processes are starting.
        self._spawning_for: list[str] = []
        #: Jobs waiting for a process (none of their user's and no spare was idle), and whose.
        self._waiting = 0
        self._waiting_for: Counter[str] = Counter()
        #: The user of the last job that took a process (under job accounts, its spares are theirs).
        self._last_owner = owners.LOCAL
        self._closed = False
        self._last_failure: str | None = None
        self._thread = threading.Thread(target=self._keep_warm, name="devicefleet-spawner", daemon=True)
        #: Called (outside the lock) when a process was started or ended: the registry shows them.
        self.on_change: Callable[[], None] | None = None
        #: Where a device group's own job process starts (:meth:`run` ``apart``): the group host
        #: under systemd, whose unit may open every GPU of the host; None: this worker's child.
        self.group_host: GroupHostLink | None = None

    # -- life --------------------------------------------------------------------------------

    def start(self) -> Hello:
        """Start the first job process and wait for its hello, then keep a spare warm.

        Raises:
            ProcessGone: the process refused (a job module does not import, the device is not
                visible: see its ``refused``) or did not get ready in time.
        """
        first = self._spawn(owners.LOCAL if self.accounts else None)
        hello = first.wait_hello(self.policy.start_timeout_s)
        with self._cond:
            self._idle.append(first)
        self._thread.start()
        return hello

    def close(self) -> None:
        """End every job process (a running job's too) and stop spawning."""
        with self._cond:
            self._closed = True
            processes = [*self._idle, *self._busy]
            self._idle.clear()
            self._cond.notify_all()
        for process in processes:
            process.kill("the worker is leaving")
        if self._thread.is_alive():
            self._thread.join(SUPERVISOR_JOIN_S)

    def kill_all_now(self) -> None:
        """SIGKILL every job process group at once (a worker that must exit now; called from a
        signal handler, so it takes no lock and waits for nothing)."""
        for process in [*list(self._idle), *list(self._busy)]:
            process.kill_now("the worker is exiting now")

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job runs; False if one still did after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pids(self) -> list[int]:
        """The job processes alive now (running a job first)."""
        with self._cond:
            return [p.pid for p in [*self._busy, *self._idle] if p.alive]

    @property
    def spare_pids(self) -> list[int]:
        """The idle job processes that ran no job yet: any user's job may take one."""
        with self._cond:
            return [p.pid for p in self._idle if p.alive and p.jobs_run == 0]

    # -- running a job -----------------------------------------------------------------------

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
        budget = None
        if slot is not None:
            if job.devices is None:  # a group's job comes with its devices' cores
                job = self._in_slot(job, slot, process)
            # A group's slot carries its budget: the sum of its devices' (tasks.core.groups).
            if slot.budget_bytes is not None and self.meter is not None:
                budget = _Budget(slot, self.meter)
        cpu_before = _cpu_seconds(process.pid)
        ended = _Run(process, job, watch, self.policy.cancel_grace_s, budget).wait()
        ended = _with_busy(ended, cpu_before, _cpu_seconds(process.pid), len(job.cores or self.spec.cores))
        retire = ended.retired or self._retire_reason(process, ended.finished)
        if retire is None and job.devices is not None and _has_children(process.pid):
            # A group's job may have started processes over all its devices (a launcher's, or
            # mp.spawn's): any left end with this process's group, before the devices run other jobs.
            retire = "a device group's job left processes behind: they end with it"
        self._give_back(process, retire)
        return ended if retire == ended.retired else dataclasses.replace(ended, retired=retire)

    def run_pack(self, pack: RunPack, watches: Mapping[str, Watch], slot: Slot,
                 on_end: Callable[[str, Ended], None], refill: Refill | None = None) -> None:
        """Run ``pack`` (several trials of one job, trained at once: :mod:`tasks.worker.pack`)
        in one ready job process, in ``slot``, and watch each member with its own watch of
        ``watches``: its reports relayed, its own stop sent to it alone (the first member's
        preemption or worker stop to all: the pack holds one slot and makes way as a whole),
        and its ending handed to ``on_end(job_id, ended)`` as soon as the process ends it. Every
        member gets exactly one ending; those the pack could not finish (its process died, went
        past the slot's budget, or a member did not stop within its grace) end as
        :data:`~tasks.core.wire.Outcome.UNPACK`, to run again alone. With ``refill``, a place a
        member frees is offered to the next trial ``refill()`` takes from the pack's queue (its
        message and its watch; None: no more), watched and ended as the first members are.

        Raises:
            NoJobProcess: none became ready within the start timeout (no member was ended).
        """
        process = self._take(owners.pack_owner(pack.members))
        first = self._in_slot(pack.members[0], slot, process)
        placed = {"slot": first.slot, "cores": first.cores, "torch_threads": first.torch_threads,
                  "allocator_limit_bytes": first.allocator_limit_bytes}
        pack = RunPack(members=[member.model_copy(update=placed) for member in pack.members], refill=refill is not None)
        budget = _Budget(slot, self.meter) if slot.budget_bytes is not None and self.meter is not None else None
        run = _PackRun(process, pack, dict(watches), self.policy.cancel_grace_s, budget, on_end, refill, placed)
        last, retire = run.wait()
        retire = retire or self._retire_reason(process, last)
        self._give_back(process, retire)

    def needs_own_process(self, env: dict[str, str]) -> bool:
        """Whether a job whose process must see ``env`` (a device group's visibility) cannot run
        in one of this device's processes: CUDA reads its visibility once, at its start."""
        return any(self._env.get(name) != value for name, value in env.items())

    def _run_apart(self, job: RunJob, watch: Watch, apart: Apart) -> Ended:
        """Run ``job`` in a process of its own, started with ``apart.env`` over the device's
        environment and pinned to ``job.cores`` (a GPU group's, whose ``CUDA_VISIBLE_DEVICES``
        lists all its GPUs), within ``apart.budget_bytes`` of memory where this device measures
        it, and end that process after it. Under systemd it is the group host's child
        (:attr:`group_host`), whose unit may open the group's GPUs; else this worker's.

        Raises:
            NoJobProcess: it did not become ready within the start timeout.
        """
        cores = sorted(job.cores or self.spec.cores)
        threads = job.torch_threads or len(cores)
        spec, account = self._account(owners.owner_of(job)) if self.accounts is not None else (self.spec, None)
        spec = spec.model_copy(update={"cores": cores, "torch_threads": threads})
        try:
            process = JobProcess(spec, {**self._env, **apart.env, "OMP_NUM_THREADS": str(threads)}, self._cwd, self.label,
                                 self.group_host, self.policy.start_timeout_s, account=account)
        except ProcessGone as exc:
            raise NoJobProcess(f"{self.label}: the group's own job process did not start: {exc}") from None
        with self._cond:
            self._busy.add(process)
        try:
            try:
                process.wait_hello(self.policy.start_timeout_s)
            except ProcessGone as exc:
                raise NoJobProcess(f"{self.label}: the group's own job process did not start: {exc}") from None
            budget = None
            if apart.budget_bytes is not None and self.meter is not None:
                budget = _Budget(Slot(index=job.slot or 0, cores=cores, threads=threads, budget_bytes=apart.budget_bytes),
                                 self.meter)
            return _Run(process, job, watch, self.policy.cancel_grace_s, budget).wait()
        finally:
            process.kill("its group's job ended")
            with self._cond:
                self._busy.discard(process)
                self._cond.notify_all()

    def _in_slot(self, job: RunJob, slot: Slot, process: JobProcess) -> RunJob:
        """``job`` on ``slot``'s cores and threads; on a GPU, its allocator capped at the slot's
        budget less what the process held on the device before it (its CUDA context)."""
        limit = None
        if slot.budget_bytes is not None and self.spec.torch_device.startswith("cuda"):
            held = 0
            if self.meter is not None and self.meter.kind == "device":
                if process.device_baseline is None:
                    process.device_baseline = self.meter.used(process.pid) or 0
                held = process.device_baseline
            limit = max(0, slot.budget_bytes - held)
        return job.model_copy(update={"slot": slot.index, "cores": slot.cores, "torch_threads": slot.threads,
                                      "allocator_limit_bytes": limit})

    def _retire_reason(self, process: JobProcess, finished: Finished | None) -> str | None:
        if finished is None:
            return "its job was not finished by it"
        if finished.retire:
            return finished.retire
        growth = process.rss_growth_bytes(finished.rss_bytes)
        if self.policy.max_memory_growth_bytes and growth > self.policy.max_memory_growth_bytes:
            return (f"its memory grew by {growth / 2**20:.0f} MiB, past the threshold of "
                    f"{self.policy.max_memory_growth_bytes / 2**20:.0f} MiB")
        if self.policy.jobs_per_process and process.jobs_run >= self.policy.jobs_per_process:
            return f"it ran jobs_per_process={self.policy.jobs_per_process} jobs"
        return None

    def _take(self, owner: str) -> JobProcess:
        """A ready process for a job of ``owner``: its own warm one, else the spare (then
        ``owner``'s), else the next fresh one (:func:`owners.pick`)."""
        deadline = time.monotonic() + self.policy.start_timeout_s
        checked = False
        with self._cond:
            while True:
                for dead in [p for p in self._idle if not p.alive]:
                    self._idle.remove(dead)
                    logger.warning("%s: idle job process %d died (%s); replacing it", self.label,
                                   dead.pid, dead.exit_text())
                    dead.kill("it died while idle")  # reaped, its group and pipe closed
                    self._cond.notify_all()
                process = owners.pick(self._idle, owner)
                if process is not None:
                    self._idle.remove(process)
                    spare, process.owner = process.jobs_run == 0, owner
                    self._last_owner = owner
                    self._busy.add(process)
                    self._cond.notify_all()  # the spare may be taken: the spawner makes another
                    break
                if self.accounts is not None and not checked:
                    self.accounts.resolve(owner)  # NoJobAccount now, not a start timeout later
                    checked = True
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise NoJobProcess(
                        f"{self.label}: no job process became ready in {self.policy.start_timeout_s:g} s"
                        + (f"; the last start failed: {self._last_failure}" if self._last_failure else ""))
                self._waiting += 1
                self._waiting_for[owner] += 1
                self._cond.notify_all()  # one more spare wanted
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
                    self._waiting_for[owner] -= 1
                    if not self._waiting_for[owner]:
                        del self._waiting_for[owner]
        if spare:
            self._changed()  # the registry lists the spares
        return process

    def _give_back(self, process: JobProcess, retire: str | None) -> None:
        with self._cond:
            self._busy.discard(process)
            if retire is None and not self._closed:
                self._idle.insert(0, process)  # the warm one first: its caches are hot
            self._cond.notify_all()
        if retire is not None:
            logger.info("%s: retiring job process %d: %s", self.label, process.pid, retire)
            process.kill(retire)
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception as exc:  # noqa: BLE001  (the registry's view is best effort)
                logger.debug("%s: on_change failed: %s", self.label, exc)

    # -- spawning ----------------------------------------------------------------------------

    def _spawn(self, owner: str | None = None) -> JobProcess:
        """A fresh job process: unowned, or under job accounts ``owner``'s, started as their
        system account (:meth:`_account`).

        Raises:
            ProcessGone: it could not start.
            NoJobAccount: ``owner`` has no usable account on this host.
        """
        if self.accounts is None:
            return JobProcess(self.spec, self._env, self._cwd, self.label)
        spec, account = self._account(owner or owners.LOCAL)
        process = JobProcess(spec, self._env, self._cwd, self.label, account=account)
        process.owner = owner or owners.LOCAL
        return process

    def _account(self, owner: str) -> tuple[ProcessSpec, JobAccount | None]:
        """The spec and system account of ``owner``'s job processes under job accounts: their
        artifacts and curves go to the user's own folder; a job that names no user runs as the
        worker (None).

        Raises:
            NoJobAccount: ``owner`` has no usable account on this host.
        """
        assert self.accounts is not None
        account = self.accounts.resolve(owner)
        if account is None:
            return self.spec, None
        return self.spec.model_copy(update={
            "artifacts_dir": str(account.folder), "tensorboard_dir": str(account.folder / TENSORBOARD_SUBDIR),
            "account": account.account}), account

    def _room(self) -> tuple[bool, JobProcess | None, str | None]:
        """Whether to spawn a process now (one per slot and the spares, or a job of a user with
        no process of theirs waits), the idle one to retire first to stay within :attr:`most`
        (the least recently used of some user's), and under job accounts whose the new one is
        (:func:`owners.plan_accounts_spawn`). Called under the lock."""
        if self.accounts is not None:
            plan = owners.plan_accounts_spawn(self._idle, len(self._busy), self._spawning_for, self._waiting_for,
                                              self._last_owner, self.warm, self.most, SPARE_PROCESSES)
            return (False, None, None) if plan is None else (True, plan[1], plan[0])
        alive = len(self._idle) + len(self._busy) + self._spawning
        unowned = owners.spares(self._idle) + self._spawning
        if alive >= self.warm and unowned >= SPARE_PROCESSES + self._waiting:
            return False, None, None
        if alive < self.most:
            return True, None, None
        old = owners.victim(self._idle)
        return old is not None, old, None

    def _keep_warm(self) -> None:
        backoff = RESPAWN_BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._closed and not (room := self._room())[0]:
                    self._cond.wait()
                if self._closed:
                    return
                old, owner = room[1], room[2]
                if old is not None:
                    self._idle.remove(old)
                self._spawning += 1
                if owner is not None:
                    self._spawning_for.append(owner)
            if old is not None:
                logger.info("%s: retiring job process %d of user %r: its place goes to a fresh spare",
                            self.label, old.pid, old.owner)
                old.kill("its place went to a fresh spare for another user's job")
                self._changed()
            process: JobProcess | None = None
            try:
                process = self._spawn(owner)
                process.wait_hello(self.policy.start_timeout_s)
                failure = None
            except (ProcessGone, OSError, NoJobAccount) as exc:
                failure = str(exc)
                logger.error("%s: a job process failed to start: %s", self.label, failure)
            with self._cond:
                self._spawning -= 1
                if owner is not None:
                    self._spawning_for.remove(owner)
                self._last_failure = failure
                if failure is None and process is not None and not self._closed:
                    self._idle.append(process)
                    process = None
                self._cond.notify_all()
                if failure is not None:
                    self._cond.wait(backoff)
            if process is not None and failure is None:
                process.kill("the worker is leaving")  # spawned while the supervisor closed
            elif failure is None:
                self._changed()
            backoff = RESPAWN_BACKOFF_S[0] if failure is None else min(RESPAWN_BACKOFF_S[1], backoff * 2)


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` and its reaped children used so far (None: it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system + times.children_user + times.children_system)


def _with_busy(ended: Ended, before: float | None, after: float | None, cores: int) -> Ended:
    """``ended`` with the seconds its job kept its cores busy (CPU seconds over the cores it
    ran on): what ``devicefleet usage`` says of a CPU device (:mod:`tasks.ops.usage`)."""
    if before is None or after is None or after < before:
        return ended
    return dataclasses.replace(ended, busy_s=(after - before) / max(1, cores))


def _has_children(pid: int) -> bool:
    """Whether process ``pid`` has a child (a job's leftover: the job process itself starts none
    between jobs)."""
    try:
        return bool(psutil.Process(pid).children())
    except psutil.Error:
        return False


@dataclass
class _Budget:
    """A running job's slot budget and the meter it is measured with."""

    slot: Slot
    meter: MemoryMeter
    next_sample: float = 0.0

    def over(self, process: JobProcess, watch: Watch) -> tuple[int, int] | None:
        """Sample the job's memory when due; ``(used, budget)`` once it is past its budget."""
        now = time.monotonic()
        if now < self.next_sample:
            return None
        self.next_sample = now + MEMORY_SAMPLE_S
        used = self.meter.used(process.pid)
        if used is None:
            return None
        watch.memory(used)
        budget = self.slot.budget_bytes
        if budget is None or used <= budget:
            return None
        exact = self.meter.exact(process.pid)  # the costlier figure, only when the cheap one is over
        return (exact, budget) if exact is not None and exact > budget else None


class _Run:
    """One job in one process, from :class:`RunJob` to its end."""

    def __init__(self, process: JobProcess, job: RunJob, watch: Watch, grace_s: float,
                 budget: _Budget | None = None) -> None:
        self.process = process
        self.job = job
        self.watch = watch
        self.grace_s = grace_s
        self.budget = budget
        self.stop: StopJob | None = None
        self._stop_sent_at = 0.0

    def wait(self) -> Ended:
        """The run's end, with the stop the worker sent it (:meth:`Ended.under`)."""
        return self._wait().under(self.stop)

    def _wait(self) -> Ended:
        self.process.send(self.job)
        if self.budget is not None:  # the first sample once the job had MEMORY_SAMPLE_S to start
            self.budget.next_sample = time.monotonic() + MEMORY_SAMPLE_S
        while True:
            try:
                message = self.process.receive(POLL_S)
            except ProcessGone as gone:
                if self.process.killed_because is not None:  # the worker ended it: it is leaving
                    return self._stopped(self.process.killed_because)
                return self._crashed(str(gone))
            if isinstance(message, Finished):
                return Ended(outcome=message.outcome, finished=message, error=message.error,
                             error_module=message.error_module, pid=self.process.pid, retired=None)
            if isinstance(message, Report):
                self.watch.report(message.fields)
            elif isinstance(message, LogLines):
                self.watch.log(message.lines)
            elif isinstance(message, ModeMessage):  # the run mode's own: its watch answers it
                if (answer := self.watch.heard(message)) is not None:
                    self.process.send(answer)
            # Asked after every message too: a job that reports often is stopped all the same.
            if self._should_end():
                return self._ended()
            if self.budget is not None and (over := self.budget.over(self.process, self.watch)):
                return self._past_budget(*over)

    def _should_end(self) -> bool:
        """Ask the watch; send its stop once; True once the grace after it has run out."""
        now = time.monotonic()
        if self.stop is None:
            stop = self.watch.stop()
            if stop is not None and (stop := self.watch.act_on(stop)) is not None:
                self.stop, self._stop_sent_at = stop, now
                self.process.send(stop)
            return False
        return now - self._stop_sent_at > self._grace_s()

    def _grace_s(self) -> float:
        stop = self.stop
        return stop.grace_s if stop is not None and stop.grace_s is not None else self.grace_s

    def _ended(self) -> Ended:
        assert self.stop is not None
        stop = self.stop
        grace_s = self._grace_s()
        self.process.kill(f"{stop.reason.value}: no stop at ctx.progress() within {grace_s:g} s")
        error, outcome = STOPS[stop.reason]
        message = (f"{stop.message}; it did not stop at ctx.progress() within {grace_s:g} s, so "
                   f"its process {self.process.pid} and everything it started were ended "
                   f"({self.process.exit_text()})")
        return Ended.by_worker(error, message, self.process.pid, f"ended after {stop.reason.value}", outcome)

    def _past_budget(self, used: int, budget: int) -> Ended:
        assert self.budget is not None
        slot, kind = self.budget.slot, self.budget.meter.kind
        what = "GPU memory" if kind == "device" else "resident memory"
        # A group's budget is its devices' together (tasks.core.groups.group_budget).
        owner = f"group {'+'.join(self.job.devices)}" if self.job.devices else f"slot {slot.index}"
        reason = f"past its {'group' if self.job.devices else 'slot'}'s memory budget"
        self.process.kill(f"{reason} ({used / memory.MiB:.0f} MiB)")
        message = (f"job {self.job.job_id} ({self.job.job}) held {used / memory.MiB:.0f} MiB of {what}, past "
                   f"{owner}'s budget of {budget / memory.MiB:.0f} MiB, so its process "
                   f"{self.process.pid} and everything it started were ended ({self.process.exit_text()})")
        return Ended.by_worker(OutOfMemory, message, self.process.pid, reason,
                               figures=memory.figures(used, budget, kind, slot.index))

    def _stopped(self, because: str) -> Ended:
        message = (f"job {self.job.job_id} ({self.job.job}) was ended with its process {self.process.pid}: "
                   f"{because}")
        return Ended.by_worker(WorkerStopped, message, self.process.pid, because)

    def _crashed(self, how: str) -> Ended:
        process = self.process
        tail = process.tail_text()
        process.kill("its job crashed it")
        message = (f"the job process {process.pid} running {self.job.job} ({self.job.job_id}) died: "
                   f"{how}; its last lines: {tail}")
        return Ended.by_worker(JobCrashed, message, process.pid, f"crashed: {how}")


class _PackRun:
    """One pack of trials in one process, from :class:`RunPack` to its last member's end."""

    def __init__(self, process: JobProcess, pack: RunPack, watches: dict[str, Watch], grace_s: float,
                 budget: _Budget | None, on_end: Callable[[str, Ended], None], refill: Refill | None = None,
                 placed: dict[str, Any] | None = None) -> None:
        self.process = process
        self.refill = refill
        #: The leader's slot, cores, threads and allocator limit: a refilled member's too.
        self.placed = placed or {}
        self.pack = pack
        self.watches = watches
        self.grace_s = grace_s
        self.budget = budget
        self.on_end = on_end
        self.leader = pack.members[0].job_id
        #: The members not ended yet, each with the stop sent to it and when (None: none yet).
        self.open: dict[str, tuple[StopJob, float] | None] = {m.job_id: None for m in pack.members}

    def wait(self) -> tuple[Finished | None, str | None]:
        """Run the pack to its end; returns the last member's account (None: the process did not
        finish the pack) and why the process must retire (None: it may run the next job)."""
        self.process.send(self.pack)
        if self.budget is not None:
            self.budget.next_sample = time.monotonic() + MEMORY_SAMPLE_S
        last: Finished | None = None
        retire: str | None = None
        while self.open:
            try:
                message = self.process.receive(POLL_S)
            except ProcessGone as gone:
                because = self.process.killed_because  # the worker ended it: it is leaving
                retired = because or f"crashed: {gone}"
                self._end_open(because or f"its process died: {gone}; its last lines: {self.process.tail_text()}",
                               retired=retired)
                return None, retired
            if isinstance(message, Finished):
                job_id = message.job_id or self.leader
                if job_id in self.open:
                    sent = self.open.pop(job_id)
                    ended = Ended(outcome=message.outcome, finished=message, error=message.error,
                                  error_module=message.error_module, pid=self.process.pid, retired=None)
                    self._end(job_id, ended.under(sent[0] if sent is not None else None))
                    last, retire = message, retire or message.retire
            elif isinstance(message, Report):
                watch = self.watches.get(message.job_id or self.leader)
                if watch is not None:
                    watch.report(message.fields)
            elif isinstance(message, LogLines):
                self.watches[self.leader].log(message.lines)
            elif isinstance(message, WantMember):
                self.process.send(NewMember(member=self._next_member()))
            if (late := self._ask_stops()) is not None:
                self._kill_for(late)
                return None, f"ended after {late.reason.value}"
            if self.budget is not None and (over := self.budget.over(self.process, self.watches[self.leader])):
                used, budget = over
                reason = f"past its slot's memory budget ({used / memory.MiB:.0f} of {budget / memory.MiB:.0f} MiB)"
                self.process.kill(reason)
                self._end_open(f"the pack went {reason}", retired=reason)
                return None, reason
        return last, retire

    def _next_member(self) -> RunJob | None:
        """The trial that takes a freed place: the next of the pack's queue, watched from now on;
        None when the pack is making way (a preemption or stop asked of the whole pack)."""
        if self.refill is None or any(sent is not None and sent[0].reason in (StopReason.PREEMPT, StopReason.SHUTDOWN)
                                      for sent in self.open.values()):
            return None
        taken = self.refill()
        if taken is None:
            return None
        job, watch = taken
        job = job.model_copy(update=self.placed)
        self.watches[job.job_id] = watch
        self.open[job.job_id] = None
        return job

    def _end(self, job_id: str, ended: Ended) -> None:
        # Every member held the slot for the pack's time: each counts its share of it.
        self.on_end(job_id, dataclasses.replace(ended, shared_by=len(self.pack.members)))

    def _ask_stops(self) -> StopJob | None:
        """Ask each open member's watch for its stop and send it to that member alone (the
        leader's preemption or worker stop to every member); returns a stop whose grace ran out."""
        now = time.monotonic()
        # The pack holds the leader's slot: once the leader's own trial has ended (members that
        # took freed places train on), its watch is still asked whether the slot must make way.
        leader_gone = self.leader not in self.open and any(sent is None for sent in self.open.values())
        for job_id in list(self.open) + ([self.leader] if leader_gone else []):
            sent = self.open.get(job_id)
            if sent is not None:
                if now - sent[1] > (sent[0].grace_s if sent[0].grace_s is not None else self.grace_s):
                    return sent[0]
                continue
            watch = self.watches[job_id]
            # The ended leader's own stops (its cancel, its time limit) are nobody's now: only
            # what its slot is asked, which its own stops must not hide.
            asked = watch.stop() if job_id in self.open else watch.slot_stop()
            stop = watch.act_on(asked) if asked is not None else None
            if stop is None:
                continue
            whole = job_id == self.leader and stop.reason in (StopReason.PREEMPT, StopReason.SHUTDOWN)
            for member in (list(self.open) if whole else [job_id]):
                if self.open.get(member) is None:
                    member_stop = stop.model_copy(update={"job_id": member})
                    self.open[member] = (member_stop, now)
                    self.process.send(member_stop)
        return None

    def _kill_for(self, late: StopJob) -> None:
        """A member did not stop at ``ctx.progress()`` within its grace: the process goes, the
        members asked to stop end with their stop's error, the others run again alone."""
        because = f"{late.reason.value}: no stop at ctx.progress() within its grace"
        self.process.kill(because)
        for job_id, sent in list(self.open.items()):
            if sent is None:
                continue
            stop = sent[0]
            error, outcome = STOPS[stop.reason]
            self.open.pop(job_id)
            self._end(job_id, Ended.by_worker(
                error, f"{stop.message}; its pack did not stop at ctx.progress() within its grace, so its process "
                       f"{self.process.pid} was ended ({self.process.exit_text()})",
                self.process.pid, because, outcome, stop=stop))
        self._end_open(f"a member of its pack did not stop in time ({late.message})", retired=because)

    def _end_open(self, why: str, retired: str) -> None:
        for job_id in list(self.open):
            sent = self.open.pop(job_id)
            if sent is not None and sent[0].reason in (StopReason.CANCEL, StopReason.FENCED, StopReason.PREEMPT):
                # Asked to stop, and the process went first: the stop's ending, as a lone job's.
                self._end(job_id, Ended.stopped(sent[0], f"{sent[0].message}; its pack's process went ({why})"))
                continue
            self._end(job_id, Ended.by_worker(
                JobCrashed, f"pack member {job_id} ({self.pack.members[0].job}): {why}; it goes back to its queue "
                            "to run alone", self.process.pid, retired, Outcome.UNPACK))
