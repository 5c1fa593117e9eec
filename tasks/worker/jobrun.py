"""One job's life on its worker apart from running it: busy in the registry, its entry, its
stored end (:class:`JobRun`), and the exception a failed job's end is stored as."""

from __future__ import annotations

import builtins
import time
from typing import Any

from celery import Task, states
from celery.exceptions import TaskRevokedError
from celery.utils.serialization import create_exception_cls

from ..core import errors
from ..core.backend import attach_entry
from ..core.defaults import HEARTBEAT_COALESCE_S
from ..core.errors import OutOfMemory
from ..core.job import JobMetric
from ..core.jobstate import Attempt, hand_over
from ..core.keys import PREEMPTIONS_HEADER
from ..core.records import BusyInfo, Entry, ErrorInfo, JobOptions
from ..core.wire import JobInfo, Outcome, RunJob
from . import accounting
from .device import DeviceWorker
from .slots import Slot
from .supervisor import Ended


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
