"""Running a job: the Celery task behind ``devicefleet.<job>``, and the chord's collect step.

Each allowlisted job is a :class:`JobTask` registered by the worker's jobs step
(:class:`tasks.worker.steps.JobsStep`) with the worker's services, all built and running by the
time a job arrives. Sent to ``cpu``, ``gpu`` or ``fleet`` it runs on whichever device of that
kind takes it; sent to ``device.<name>`` on exactly that device. It returns the device's
:class:`~tasks.core.records.Entry` as a dict. When the job fails (it raises, its kwargs or
options are invalid, it runs out of memory, its process crashes, it runs past its time limit)
the task ends in FAILURE with the job's own exception type, and the error entry rides along with
it (:func:`tasks.core.backend.attach_entry`) so that a fan-out's chord still collects every
device.

The job itself runs in a job process (:mod:`tasks.worker.supervisor`); a job's life here is three
stages with a typed value between each (:func:`execute`): its admission
(:func:`tasks.worker.admission.admit`) gives :class:`~tasks.worker.admission.Admitted` or a
:data:`~tasks.worker.disposition.Disposition`; an admitted job runs in its run mode
(:mod:`tasks.worker.modes`) while a :class:`~tasks.worker.watch.JobWatch` publishes its progress
and says when to stop it, which gives the run's :class:`~tasks.worker.supervisor.Ended`; that
becomes a disposition (:func:`tasks.worker.disposition.settle`), which
:func:`tasks.worker.disposition.apply` carries out.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from celery import Task
from celery.utils.serialization import get_pickled_exception
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.utils.encoding import safe_repr

from ..core.queues import key_device
from ..core.records import Entry, ErrorInfo
from ..core.wire import JobInfo
from . import blackhole
from .admission import Admitted, admit
from .device import DeviceWorker
from .disposition import JobFacts, JobRun, apply, preemptions_of, settle
from .launch import Launch
from .supervisor import Ended
from .watch import JobWatch

logger = logging.getLogger(__name__)


class JobRequest(Request):  # type: ignore[misc]
    """Celery's request of a job task, with a job's MemoryError a failure like any other.

    (The acknowledgement of a job's message is folded into the store of its result: see
    :class:`tasks.core.jobstate.MessageAck`; Celery's acknowledgement that follows is then only
    kombu's in-memory bookkeeping, :class:`tasks.core.transport.QoS`.)

    Celery takes a MemoryError out of a task for the worker process's own: it raises it again and
    leaves the message unacknowledged, so the device would hold its one prefetch slot and take
    no more work. A job that ran out of memory (:class:`OutOfMemory` is a MemoryError) has had
    its failure and error entry stored by the trace (``return_ok``): acknowledge it as any failed
    job is.
    """

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if not (return_ok and isinstance(exc, MemoryError)):
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        worker_state.task_ready(self)
        if self.task.acks_late:
            if self.task.acks_on_failure:
                self.acknowledge()
            else:
                self.reject(requeue=False)
        if send_failed_event:
            self.send_event("task-failed", exception=safe_repr(get_pickled_exception(exc)),
                            traceback=exc_info.traceback)
        return None


class JobTask(Task):  # type: ignore[misc]
    """The Celery task of one job on one device worker (made by the jobs step per job)."""

    #: Set per job by the jobs step: the job, and the worker's services it runs with.
    job: JobInfo
    device_worker: DeviceWorker
    #: A job's failures are expected: its job process logged its traceback; Celery logs the
    #: failure without a worker-side traceback dump, which would show only this module.
    throws = (Exception,)
    #: Kwargs are checked against the job's schema (in the job process), not a signature.
    typing = False
    Strategy = "tasks.worker.strategy:guarded_strategy"
    Request = "tasks.worker.runner:JobRequest"
    #: The lease's take script stores STARTED (LeaseKeeper.hold), in the same round trip.
    track_started = False
    #: A job's message goes back to its queue by ``task.retry`` only when it was not run to its
    #: end (:class:`tasks.worker.disposition.Requeue`): never a failure, so never bounded.
    #: (``retry(max_retries=None)`` means the task's bound, Celery's default 3: a job handed back
    #: a 4th time failed as MaxRetriesExceededError.)
    max_retries = None

    def run(self, **kwargs: Any) -> dict[str, Any]:
        return execute(self.device_worker, self, self.job, kwargs)


def execute(worker: DeviceWorker, task: Task, job: JobInfo, kwargs: Any) -> dict[str, Any]:
    """Run one job: admit it, run it in its mode, dispose of its ending; returns its entry.

    Raises:
        Exception: the job failed (its options are invalid, it took its worker down
            ``max_attempts`` times: ``WorkerLost``, or it ran and failed); the exception carries
            its error entry, and its failure is stored with its message acknowledged.
        celery.exceptions.Ignore, Retry, Reject: its message goes elsewhere
            (:func:`tasks.worker.disposition.apply`).
    """
    with ExitStack() as held:
        admitted = admit(worker, task, held)
        if not isinstance(admitted, Admitted):
            return apply(admitted, JobRun(worker, task, job), ran=False)
        options, mode, attempt = admitted.options, admitted.mode, admitted.attempt
        job_id = str(task.request.id or "")
        with mode.seat(worker.slots, job_id) as seat:
            run = JobRun(worker, task, job, seat.slot if seat.own else None, options)
            watch = JobWatch(worker, task, run.job_id, options, seat.slot.index, attempt, preemptible=seat.preemptible)
            siblings = (functools.partial(worker.siblings.take, task, level=options.priority)
                        if task.request.id is not None else None)
            launch = Launch(message=run.job_message(kwargs, options, attempt), options=options, watch=watch,
                            slot=seat.slot, token=attempt.token if attempt is not None else 0,
                            on_start=run.start_clock, siblings=siblings)
            ended = _run(worker, watch, launch, mode.run)
            request = task.request
            facts = JobFacts(
                options=options, by_name=admitted.by_name,
                borrowed=worker.leases.borrowed(run.job_id), preemptions=preemptions_of(request),
                sent_back=lambda ended: blackhole.sends_back(worker, request, ended, mode.alone, run.run_s(ended)))
            return apply(settle(ended, facts), run)


def _run(worker: DeviceWorker, watch: JobWatch, launch: Launch, run: Callable[[Launch], Ended]) -> Ended:
    """Run ``launch`` with ``run`` (its mode's), known to the preemption's registry while it runs."""
    options = launch.options
    preemption = worker.preemption if watch.preemptible else None
    if preemption is not None:
        lent = watch.attempt is not None and watch.attempt.borrowed and options.user is not None
        preemption.running(watch.job_id, options.priority,
                           borrowed=(str(options.user), worker.device.kind.value) if lent else None)
    try:
        return run(launch)
    finally:
        if preemption is not None:
            preemption.done(watch.job_id)
        # Every report relayed before the job's end is stored (a fenced job's are left).
        watch.drain()


def collect(entries: list[dict[str, Any]], devices: list[str]) -> dict[str, dict[str, Any]]:
    """The chord's body: ``{device: entry}``, in the order of ``devices`` (the header's order;
    ``<device>/<copy>`` keys for a fan-out that ran one job per slot).

    A failed device's entry is its error entry (:class:`tasks.core.backend.FleetBackend`).
    """
    out: dict[str, dict[str, Any]] = {}
    for key, entry in zip(devices, entries, strict=False):
        device = key_device(key)
        out[key] = {**entry, "device": device} if isinstance(entry, dict) else Entry.make(
            device=device, worker=None, output=None, started=None, finished=None,
            error=ErrorInfo(type="FanOutError", message=f"no entry from {key}: got {entry!r:.200}"),
        ).to_dict()
    return out
