"""Where a job's message goes: a :data:`Disposition`, decided as a value (:func:`settle`, or the
job's admission: :func:`tasks.worker.runner.execute`), applied in one place (:func:`apply`, the one
place of the worker that raises Celery's ``Retry``, ``Ignore``, ``Reject``) on the job's
:class:`JobRun` (its busy state, its entry, the store of its end)."""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, assert_never

import redis
from celery import Task, states
from celery.exceptions import Ignore, Reject, TaskRevokedError
from celery.utils.serialization import create_exception_cls

from ..core import errors
from ..core.backend import attach_entry
from ..core.defaults import CAP_RETRY_S, GIVE_WAY_S, HEARTBEAT_COALESCE_S
from ..core.errors import DeviceFailed, OutOfMemory
from ..core.job import JobMetric
from ..core.jobcount import count_preemption
from ..core.jobstate import Attempt, hand_over
from ..core.keys import FRONT_HEADER, OPTIONS_HEADER, PREEMPTIONS_HEADER
from ..core.records import BusyInfo, Entry, ErrorInfo, JobOptions
from ..core.wire import JobInfo, Outcome, RunJob
from . import accounting
from .device import DeviceWorker
from .lease import deaths_kept_s
from .slots import Slot
from .supervisor import Ended

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Store:
    """Store the job's end (its entry, or its failure with its entry; its lease released and its
    message acknowledged with it): how its run ``ended``, or ``failed`` (refused before it ran,
    or its error named by its worker)."""

    ended: Ended | None = None
    failed: BaseException | None = None


@dataclass(frozen=True)
class Drop:
    """Store nothing; acknowledge the message. ``fenced``: the run's worker fenced itself off it
    (its lease is left to expire, the reaper gives the job back, no death counted)."""

    fenced: bool = False


@dataclass(frozen=True)
class Requeue:
    """The same message (id, kwargs, chord) back on its queue (never a failure), ``delay_s``
    later, with ``headers`` set over its own;
    ``front``: at the front of its level's list (:data:`~tasks.core.keys.FRONT_HEADER`).
    ``release_lease``: its lease is released first (no attempt spent, no death counted);
    ``preempted``: the device counts a preemption; ``max_retries``: how many times it may come
    back so (None: without bound); ``why``: for the log."""

    delay_s: float = 0.0
    front: bool = False
    headers: Mapping[str, Any] = field(default_factory=dict)
    release_lease: bool = False
    preempted: bool = False
    max_retries: int | None = None
    why: str = ""


@dataclass(frozen=True)
class Redeliver:
    """Reject the message back to its queue (kombu's ``restore_by_tag``: a lease no replica
    confirmed, on whichever primary the channel reaches), ``why``."""

    why: str


Disposition = Store | Drop | Requeue | Redeliver


@dataclass(frozen=True)
class JobFacts:
    """What :func:`settle` needs of a job besides its ending."""

    options: JobOptions
    #: Sent to this device by name (its own queue): it could have run nowhere else.
    by_name: bool = False
    #: It ran over its user's cap (:mod:`tasks.core.caps`).
    borrowed: bool = False
    #: How many times it was preempted before (its message's header).
    preemptions: int = 0
    #: Whether a failure of it goes back to its queue (the black-hole rule,
    #: :mod:`tasks.worker.blackhole`); asked only of an :data:`~tasks.core.wire.Outcome.ERROR`.
    sent_back: Callable[[Ended], bool] = lambda ended: False


def settle(ended: Ended, job: JobFacts) -> Disposition:
    """Where a run that ``ended`` so goes, by its outcome (mypy's ``assert_never`` holds every
    outcome to one disposition)."""
    match ended.outcome:
        case Outcome.FENCED:
            # Cut off from Redis, it stopped the job itself: no result of this attempt may be stored.
            return Drop(fenced=True)
        case Outcome.PREEMPTED:
            return preempted(ended, job)
        case Outcome.UNPACK:
            # Its pack could not finish it (the pack's process died): back to its queue at once,
            # to run alone, so a trial that kills its process kills only itself the next time.
            alone = job.options.model_copy(update={"pack": None}).to_dict()
            return Requeue(headers={OPTIONS_HEADER: alone}, release_lease=True)
        case Outcome.GIVE_WAY:
            return Requeue(delay_s=GIVE_WAY_S)  # it gave its device to an older gang or group
        case Outcome.DEVICE_FAILED if job.by_name:
            # Sent to this device and no other: its entry says the device failed, at once (its
            # process may have crashed first on the failing GPU: the device's failure is why).
            return Store(ended=ended, failed=DeviceFailed(ended.stop.message) if ended.stop is not None else None)
        case Outcome.DEVICE_FAILED:
            # Its device failed under it (and is drained): back to its shared queue at once.
            why = ended.error.message if ended.error is not None else "its device failed"
            return Requeue(release_lease=True, why=why)
        case Outcome.ERROR if job.sent_back(ended):
            return Requeue(release_lease=True, why="its first fast failure on this device")
        case Outcome.OK | Outcome.ERROR | Outcome.CANCELLED | Outcome.PEER_LOST:
            return Store(ended=ended)
        case _:
            assert_never(ended.outcome)


def preempted(ended: Ended, job: JobFacts) -> Requeue:
    """A preempted job's message back on its queue (:mod:`tasks.worker.preemption`): the same
    id, kwargs, options and chord, its count of preemptions one more, at the front of its level's
    list, so it keeps its place among its level: it runs before the work of its level sent after
    it. Its lease is released first, so the worker that takes it next takes it at once. A job that
    ran ``borrowed`` (over its user's cap, :mod:`tasks.core.caps`) made way for work of its own
    level, which its user's list could come before (users go least usage first): it comes back
    :data:`~tasks.core.defaults.CAP_RETRY_S` later, at the back, so the freed slot takes that work."""
    count = job.preemptions + 1
    level = ended.stop.level if ended.stop is not None else None
    why = f"made way for {level.value if level is not None else 'higher-level'} work (preemption {count})"
    return Requeue(delay_s=CAP_RETRY_S if job.borrowed else 0.0, front=not job.borrowed,
                   headers={PREEMPTIONS_HEADER: count}, release_lease=True, preempted=True, why=why)


def apply(disposition: Disposition, run: JobRun, ran: bool = True) -> dict[str, Any]:
    """Carry ``disposition`` out for ``run`` (``ran``: after its run, which ends its busy state)
    and return its entry.

    Raises:
        Exception: its end is a failure, stored by Celery with its error entry.
        celery.exceptions.Ignore: it was dropped, or cancelled (REVOKED is stored already).
        celery.exceptions.Retry: it goes back to its queue.
        celery.exceptions.Reject: it is redelivered.
    """
    task, leases = run.task, run.worker.leases
    if ran and not isinstance(disposition, Store):
        run.idle(done=False)
    match disposition:
        case Store(ended=ended, failed=failed):
            entry = run.end(ended=ended, failed=failed)
            if entry is not None:
                return entry
            leases.settle(run.job_id, task.request)  # the store of its cancelled state released it
            raise Ignore()
        case Drop(fenced=fenced):
            if fenced:
                leases.fenced(run.job_id, deaths_kept_s(task.app))
            raise Ignore()
        case Requeue() as back:
            if back.why:
                logger.info("job %s on %s: %s; back to its queue", run.job_id, run.worker.device, back.why)
            if back.release_lease:
                leases.release(run.job_id)
            if back.preempted:
                try:
                    count_preemption(run.worker.client, run.worker.device.name)
                except redis.RedisError as exc:  # a figure only: the job goes back all the same
                    logger.warning("could not count the preemption of job %s: %s", run.job_id, exc)
            headers = {**back.headers, **({FRONT_HEADER: True} if back.front else {})}
            options = {"headers": {**dict(task.request.headers or {}), **headers}} if headers else {}
            raise task.retry(countdown=back.delay_s, max_retries=back.max_retries, **options)
        case Redeliver(why=why):
            raise Reject(why, requeue=True)
        case _:
            assert_never(disposition)


class JobRun:
    """One job's life on this worker, apart from running it: busy in the registry, its entry,
    its stored end."""

    def __init__(self, worker: DeviceWorker, task: Task, job: JobInfo, slot: Slot | None = None,
                 options: JobOptions | None = None) -> None:
        self.worker = worker
        self.task = task
        self.job = job
        self.slot = slot
        self.started = time.time()
        self.job_id = str(task.request.id or f"local-{self.started}")
        #: The job's options, once its message is made (a group's entry names the group).
        self.options: JobOptions | None = None
        if slot is not None:
            opts = options or JobOptions()
            busy = BusyInfo(job=job.name, job_id=self.job_id, since=self.started, level=opts.priority, user=opts.user)
            worker.heartbeat.update_slot(slot.index, busy=busy, after_s=HEARTBEAT_COALESCE_S)

    def start_clock(self) -> None:
        """The job starts now (a device group's, once its devices are held): its entry's
        ``started_at`` and the registry's ``since`` say so."""
        self.started = time.time()
        if self.slot is not None:
            self.worker.heartbeat.update_slot(self.slot.index, busy=BusyInfo(
                job=self.job.name, job_id=self.job_id, since=self.started), after_s=HEARTBEAT_COALESCE_S)

    def run_s(self, ended: Ended) -> float:
        """Seconds the job ran: its own process's measure (its process's start and imports not
        counted, which a loaded host can stretch past any threshold), else since this run began
        (its process died first)."""
        if ended.finished is not None and ended.finished.run_s is not None:
            return ended.finished.run_s
        return time.time() - self.started

    def job_message(self, kwargs: Any, options: JobOptions, attempt: Attempt | None = None) -> RunJob:
        self.options = options
        request = self.task.request
        return RunJob(job_id=self.job_id, job=self.job.name, kwargs=kwargs, options=options.to_dict(),
                      fan_out_id=str(getattr(request, "group", None) or self.job_id),
                      attempt=max(1, attempt.token) if attempt is not None else 1)

    def idle(self, done: bool = True) -> None:
        worker = self.worker
        with worker.counts_lock:
            worker.jobs_done += done
            jobs_done = worker.jobs_done
        if self.slot is None:
            worker.heartbeat.update(jobs_done=jobs_done, after_s=HEARTBEAT_COALESCE_S)
        else:
            worker.heartbeat.update_slot(self.slot.index, busy=None, progress=None, memory_bytes=None,
                                         worker_fields={"jobs_done": jobs_done}, after_s=HEARTBEAT_COALESCE_S)

    def end(self, ended: Ended | None = None, failed: BaseException | None = None) -> dict[str, Any] | None:
        """Hand the job's end to the store of its result (:func:`~tasks.core.jobstate.hand_over`:
        Celery's tracer stores what this returns or raises, with the end, in one script call)
        and return its entry; None when it was cancelled (REVOKED is stored here, with the end:
        Celery must store nothing more, :func:`tasks.worker.disposition.apply`).

        Raises:
            Exception: it failed; the exception carries its error entry.
        """
        self.idle()
        finished = time.time()
        result = ended.finished if ended is not None else None
        output = result.output if result is not None and ended is not None and ended.outcome is Outcome.OK else None
        error = ErrorInfo.of(failed) if failed is not None else (ended.error if ended is not None else None)
        request = self.task.request
        hand_over(request, accounting.job_end(
            self.worker, self.task.app, request, ok=error is None, started=self.started, finished=finished,
            metrics={JobMetric(name): value for name, value in result.metrics.items()} if result is not None else None,
            gpu_memory_bytes=result.gpu_memory_bytes if result is not None else None,
            shared_by=ended.shared_by if ended is not None else 1,
            busy_s=ended.busy_s if ended is not None else None,
        ))
        group_spec = self.options.group if self.options is not None else None
        entry = Entry.make(device=group_spec.name if group_spec is not None else self.worker.device.name,
                           worker=self.worker.nodename, output=output,
                           error=error, started=self.started, finished=finished, visibility=self.worker.seen,
                           slot=self.slot.index if self.slot is not None else None,
                           preemptions=preemptions_of(request))
        if error is None:
            return entry.to_dict()
        exc = failed or exception_of(error, ended.error_module if ended is not None else None)
        if ended is not None and ended.outcome is Outcome.CANCELLED:
            store_cancelled(self.task, exc, entry)
            return None
        raise attach_entry(exc, entry)


def exception_of(error: ErrorInfo, module: str | None) -> BaseException:
    """An exception of the type the job process named (devicefleet's own, a builtin, else a class
    of that name and module, as Celery makes for a type it cannot import), to store as the
    task's failure."""
    own = getattr(errors, error.type, None)
    if isinstance(own, type) and issubclass(own, errors.JobError):
        if own is OutOfMemory:
            return OutOfMemory(error.message, memory=dict(error.memory or {}))
        if own is errors.CommandFailed:
            return errors.CommandFailed(error.message, command=dict(error.command or {}))
        return own(error.message)
    builtin = getattr(builtins, error.type, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        try:
            return builtin(error.message)
        except TypeError:  # a builtin whose constructor takes more (UnicodeDecodeError)
            pass
    cls: type[BaseException] = create_exception_cls(error.type, module or "builtins")
    return cls(error.message)


def store_cancelled(task: Task, failure: BaseException, entry: Entry) -> None:
    """End a cancelled job as Celery ends a revoked one: state ``REVOKED`` (what Flower and
    ``AsyncResult.state`` show), its chord part counted, a ``task-revoked`` event, and the
    device's cancelled entry kept with it; Celery must store nothing more.
    """
    request = task.request
    exc = attach_entry(TaskRevokedError(str(failure)), entry)
    task.backend.store_result(request.id, exc, states.REVOKED, request=request)
    if request.chord:
        task.backend.on_chord_part_return(request, states.REVOKED, exc)
    task.send_event("task-revoked", terminated=False, signum=None, expired=False)


def preemptions_of(request: Any) -> int:
    """How many times the job of ``request`` was preempted before (its message's header)."""
    value = (getattr(request, "headers", None) or {}).get(PREEMPTIONS_HEADER, 0)
    return value if isinstance(value, int) and value >= 0 else 0
