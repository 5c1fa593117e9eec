"""One run loop: a job, or a pack of trials, in one job process, from its message to its end.

:class:`RunLoop` sends the run to a process its pool handed out (:mod:`tasks.worker.pool`) and
reads what the process says until every member has ended (a lone job is a pack of one member; a
pack's are trained as one packed model: :mod:`tasks.jobproc.pack_run`). What a member says goes to
its :class:`Watch`; a stop its watch asks for is sent to it, which raises at its next
``ctx.progress()``, and one that has not ended ``cancel_grace_s`` later has its process group
ended (SIGTERM, then SIGKILL); a process that dies ends a lone job as ``JobCrashed``, naming the
signal and its last lines; a run past its slot's memory budget (:class:`Budget`) has its process
group ended at once, a lone job as ``OutOfMemory`` with the figures. A pack's members that could
not finish end as :data:`~tasks.core.wire.Outcome.UNPACK`, to run again alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.defaults import JOB_POLL_S as POLL_S
from ..core.defaults import MEMORY_SAMPLE_S
from ..core.errors import JobCrashed, OutOfMemory, WorkerStopped
from ..core.records import ErrorInfo
from ..core.wire import (
    STOPS,
    Finished,
    LogLines,
    ModeMessage,
    NewMember,
    Outcome,
    Proceed,
    Report,
    RunJob,
    RunPack,
    StopJob,
    StopReason,
    WantMember,
)
from . import memory
from .jobprocess import JobProcess, ProcessGone
from .memory import MemoryMeter
from .slots import Slot

#: ``refill() -> (message, watch) | None``: the next waiting trial of a pack's queue, taken,
#: leased and watched as the pack's first members were; None: no more (:class:`RunLoop`).
Refill = Callable[[], "tuple[RunJob, Watch] | None"]

#: What a pack's members share with its leader: where and within what they run.
PLACED = ("slot", "cores", "torch_threads", "allocator_limit_bytes")


class Watch(Protocol):
    """What the run loop asks of the job it runs (implemented by the runner; a gang's and a
    group's add to it): where what the job says goes, and whether and how to stop it."""

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


class WatchOver:
    """A watch that adds to another's (a gang's): each call goes to ``inner`` unless overridden."""

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


@dataclass(frozen=True)
class Ended:
    """How a run ended, as the run loop saw it: the value the runner matches on
    (:func:`tasks.worker.disposition.settle`)."""

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


@dataclass
class Budget:
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


class RunLoop:
    """One job, or one pack of trials, in one process, from its message to its last member's end.

    ``members`` are the jobs it runs, the first the leader (whose slot the run holds); ``packed``:
    they go as one :class:`~tasks.core.wire.RunPack` (else the one member as its own
    :class:`~tasks.core.wire.RunJob`). Each member is watched by its watch of ``watches`` (its
    reports relayed, its own stop sent to it alone; the leader's preemption or worker stop to all:
    the run holds one slot and makes way as a whole), and its ending is handed to
    ``on_end(job_id, ended)`` as soon as the process ends it, exactly once. With ``refill``, a
    place a member frees is offered to the next trial ``refill()`` takes from the pack's queue,
    placed as the leader, watched and ended as the first members are."""

    def __init__(self, process: JobProcess, members: Sequence[RunJob], watches: Mapping[str, Watch], grace_s: float,
                 budget: Budget | None, on_end: Callable[[str, Ended], None], packed: bool = False,
                 refill: Refill | None = None) -> None:
        self.process = process
        self.members = list(members)
        self.packed = packed
        self.leader = self.members[0]
        self.watches = dict(watches)
        self.grace_s = grace_s
        self.budget = budget
        self.on_end = on_end
        self.refill = refill
        #: The members not ended yet, each with the stop sent to it and when (None: none yet).
        self.open: dict[str, tuple[StopJob, float] | None] = {m.job_id: None for m in self.members}

    def wait(self) -> tuple[Finished | None, str | None]:
        """Run to the last member's end; returns the last member's account (None: the process did
        not finish the run) and why the process must retire (None: it may run the next job)."""
        self.process.send(RunPack(members=self.members, refill=self.refill is not None) if self.packed
                          else self.leader)
        if self.budget is not None:  # the first sample once the job had MEMORY_SAMPLE_S to start
            self.budget.next_sample = time.monotonic() + MEMORY_SAMPLE_S
        last: Finished | None = None
        retire: str | None = None
        lead = self.watches[self.leader.job_id]
        while self.open:
            try:
                message = self.process.receive(POLL_S)
            except ProcessGone as gone:
                return None, self._gone(str(gone))
            if isinstance(message, Finished):
                job_id = message.job_id or self.leader.job_id
                if job_id in self.open:
                    sent = self.open.pop(job_id)
                    self._end(job_id, Ended(outcome=message.outcome, finished=message, error=message.error,
                                            error_module=message.error_module, pid=self.process.pid,
                                            retired=None).under(sent[0] if sent else None))
                    last, retire = message, retire or message.retire
                if not self.open:
                    break
            elif isinstance(message, Report):
                if (watch := self.watches.get(message.job_id or self.leader.job_id)) is not None:
                    watch.report(message.fields)
            elif isinstance(message, LogLines):
                lead.log(message.lines)
            elif isinstance(message, WantMember):
                self.process.send(NewMember(member=self._next_member()))
            elif isinstance(message, ModeMessage):  # the run mode's own: its watch answers it
                if (answer := lead.heard(message)) is not None:
                    self.process.send(answer)
            # Asked after every message too: a job that reports often is stopped all the same.
            if (late := self._ask_stops()) is not None:
                return None, self._kill_for(late)
            if self.budget is not None and (over := self.budget.over(self.process, lead)):
                return None, self._past_budget(*over)
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
        job = job.model_copy(update={name: getattr(self.leader, name) for name in PLACED})
        self.watches[job.job_id] = watch
        self.open[job.job_id] = None
        return job

    def _end(self, job_id: str, ended: Ended) -> None:
        # Every member held the slot for the run's time: each counts its share of it.
        self.on_end(job_id, dataclasses.replace(ended, shared_by=len(self.members)))

    def _ask_stops(self) -> StopJob | None:
        """Ask each open member's watch for its stop and send it to that member alone (the
        leader's preemption or worker stop to every member); returns a stop whose grace ran out."""
        now = time.monotonic()
        leader = self.leader.job_id
        # The run holds the leader's slot: once the leader's own trial has ended (members that
        # took freed places train on), its watch is still asked whether the slot must make way.
        leader_gone = leader not in self.open and any(sent is None for sent in self.open.values())
        for job_id in list(self.open) + ([leader] if leader_gone else []):
            sent = self.open.get(job_id)
            if sent is not None:
                if now - sent[1] > self._grace_s(sent[0]):
                    return sent[0]
                continue
            watch = self.watches[job_id]
            # The ended leader's own stops (its cancel, its time limit) are nobody's now: only
            # what its slot is asked, which its own stops must not hide.
            asked = watch.stop() if job_id in self.open else watch.slot_stop()
            stop = watch.act_on(asked) if asked is not None else None
            if stop is None:
                continue
            whole = job_id == leader and stop.reason in (StopReason.PREEMPT, StopReason.SHUTDOWN)
            for member in (list(self.open) if whole else [job_id]):
                if self.open.get(member) is None:
                    member_stop = stop.model_copy(update={"job_id": member})
                    self.open[member] = (member_stop, now)
                    self.process.send(member_stop)
        return None

    def _grace_s(self, stop: StopJob) -> float:
        return stop.grace_s if stop.grace_s is not None else self.grace_s

    def _kill_for(self, late: StopJob) -> str:
        """A member did not stop at ``ctx.progress()`` within its grace: the process goes, the
        members asked to stop end with their stop's error, a pack's others run again alone.
        Returns why the process retired."""
        grace = f"within {self._grace_s(late):g} s"
        self.process.kill(f"{late.reason.value}: no stop at ctx.progress() {grace}")
        retired = f"ended after {late.reason.value}"
        for job_id, sent in list(self.open.items()):
            if sent is not None:
                del self.open[job_id]
                error, outcome = STOPS[sent[0].reason]
                self._end(job_id, Ended.by_worker(
                    error, f"{sent[0].message}; {'its pack' if self.packed else 'it'} did not stop at ctx.progress() "
                           f"{grace}, so its process {self.process.pid} and everything it started were ended "
                           f"({self.process.exit_text()})", self.process.pid, retired, outcome, stop=sent[0]))
        self._end_open(f"a member of its pack did not stop in time ({late.message})", retired)
        return retired

    def _past_budget(self, used: int, budget: int) -> str:
        """The run went past its budget: its process goes; a lone job ends as ``OutOfMemory``
        with the figures, a pack's members run again alone. Returns why the process retired."""
        assert self.budget is not None
        slot, kind, job = self.budget.slot, self.budget.meter.kind, self.leader
        what = "GPU memory" if kind == "device" else "resident memory"
        # A group's budget is its devices' together (tasks.core.groups.group_budget).
        owner = f"group {'+'.join(job.devices)}" if job.devices else f"slot {slot.index}"
        reason = (f"past its {'group' if job.devices else 'slot'}'s memory budget ({used / memory.MiB:.0f} of "
                  f"{budget / memory.MiB:.0f} MiB)")
        self.process.kill(reason)
        message = (f"job {job.job_id} ({job.job}) held {used / memory.MiB:.0f} MiB of {what}, past "
                   f"{owner}'s budget of {budget / memory.MiB:.0f} MiB, so its process "
                   f"{self.process.pid} and everything it started were ended ({self.process.exit_text()})")
        self._end_open(f"the pack went {reason}", reason, Ended.by_worker(
            OutOfMemory, message, self.process.pid, reason, figures=memory.figures(used, budget, kind, slot.index)))
        return reason

    def _gone(self, how: str) -> str:
        """The process went before the run's end: ended by the worker (it is leaving), or dead (a
        lone job's crash names the signal and its last lines). Returns why it retired."""
        process, job = self.process, self.leader
        if (because := process.killed_because) is not None:
            self._end_open(because, because, Ended.by_worker(
                WorkerStopped, f"job {job.job_id} ({job.job}) was ended with its process {process.pid}: {because}",
                process.pid, because))
            return because
        tail = process.tail_text()
        process.kill("its job crashed it")
        retired = f"crashed: {how}"
        self._end_open(f"its process died: {how}; its last lines: {tail}", retired, Ended.by_worker(
            JobCrashed, f"the job process {process.pid} running {job.job} ({job.job_id}) died: {how}; its last "
                        f"lines: {tail}", process.pid, retired))
        return retired

    def _end_open(self, why: str, retired: str, alone: Ended | None = None) -> None:
        """End every open member, its process gone for ``why``: a lone job with ``alone``; a
        pack's member asked to stop with its stop's ending, the others to run again alone."""
        for job_id in list(self.open):
            sent = self.open.pop(job_id)
            if alone is not None and not self.packed:
                self._end(job_id, alone.under(sent[0] if sent else None))
            elif sent is not None and sent[0].reason in (StopReason.CANCEL, StopReason.FENCED, StopReason.PREEMPT):
                # Asked to stop, and the process went first: the stop's ending, as a lone job's.
                self._end(job_id, Ended.stopped(sent[0], f"{sent[0].message}; its pack's process went ({why})"))
            else:
                self._end(job_id, Ended.by_worker(
                    JobCrashed, f"pack member {job_id} ({self.leader.job}): {why}; it goes back to its queue "
                                "to run alone", self.process.pid, retired, Outcome.UNPACK))
