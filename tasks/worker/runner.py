"""Running a job: the Celery task behind ``devicefleet.<job>``, and the chord's collect step.

Each allowlisted job is a :class:`JobTask` registered by the bootstep. Sent to ``cpu``, ``gpu``
or ``fleet`` it runs on whichever device of that kind takes it; sent to ``device.<name>`` on
exactly that device. It returns the device's :class:`~tasks.core.records.Entry` as a dict. When
the job fails (it raises, its kwargs or options are invalid, it runs out of memory) the task
ends in FAILURE with the job's own exception, and the error entry rides along with it
(:func:`tasks.core.backend.attach_entry`) so that a fan-out's chord still collects every device.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from celery import Task, states
from celery.exceptions import Ignore, TaskRevokedError
from celery.utils.serialization import get_pickled_exception
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.utils.encoding import safe_repr
from pydantic import ValidationError

from ..core.backend import FINISH_ATTR, JobFinish, StoredAck, attach_entry
from ..core.devices import host_name
from ..core.errors import (
    DeviceFleetError,
    GangFailed,
    InvalidJobArguments,
    JobCancelled,
    JobError,
    OutOfMemory,
)
from ..core.job import JobContext, JobDefinition, JobFunc
from ..core.keys import OPTIONS_HEADER
from ..core.records import BusyInfo, Entry, ErrorInfo, GangSpec, JobOptions
from ..core.transport import QoS as FleetQoS
from ..core.validation import describe_validation_error
from . import accounting, heartbeat, progress
from .device import DeviceWorker
from .distributed import GIVE_WAY_S, GiveWay, Rendezvous, run_rank
from .jobs import validate_kwargs
from .oom import recycle_if_needed, release_memory, run_guarded
from .scalars import ScalarLog, run_dir

logger = logging.getLogger(__name__)

#: Attribute of a job's task request that carries its :class:`~tasks.core.backend.StoredAck`.
STORED_ACK_ATTR = "devicefleet_stored_ack"


def stored_ack(message: Any) -> StoredAck | None:
    """What the result store needs to acknowledge ``message``: on devicefleet's Redis channel
    (:class:`tasks.core.transport.QoS`, which then skips its own round trip) with no key prefix
    (the store script names the keys itself); ``None`` otherwise."""
    channel: Any = getattr(message, "channel", None)
    qos: Any = getattr(channel, "qos", None)
    tag = getattr(message, "delivery_tag", None)
    if not isinstance(qos, FleetQoS) or not isinstance(tag, str) or getattr(channel, "global_keyprefix", None):
        return None
    return StoredAck(unacked_key=qos.unacked_key, unacked_index_key=qos.unacked_index_key, delivery_tag=tag)


class JobRequest(Request):  # type: ignore[misc]
    """Celery's request of a job task, with the acknowledgement folded into the result's store,
    and a job's MemoryError a failure like any other.

    The request hands its message's :class:`~tasks.core.backend.StoredAck` to the task (in the
    request's ``properties``, which the thread pool passes as they are): the script that stores the job's
    result acknowledges the message in Redis, and :meth:`acknowledge` marks it on the channel's
    :class:`~tasks.core.transport.QoS`, so Celery's acknowledgement that follows is only kombu's
    in-memory bookkeeping, not a second round trip.

    Celery takes a MemoryError out of a task for the worker process's own: it raises it again and
    leaves the message unacknowledged, so the device would hold its one prefetch slot and take
    no more work. A job that ran out of memory (:class:`OutOfMemory` is a MemoryError) has had
    its failure and error entry stored by the trace (``return_ok``): acknowledge it as any failed
    job is.
    """

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        self._stored_ack = stored_ack(message)
        if self._stored_ack is not None:
            # Beside the message's properties, in a copy (the message keeps its own): the task's
            # request has them, and nothing sends them on (a retry copies headers, not these).
            properties = self._request_dict.get("properties") or {}
            self._request_dict["properties"] = {**properties, STORED_ACK_ATTR: self._stored_ack}

    def acknowledge(self) -> None:
        ack = self._stored_ack
        if ack is not None and ack.done and not self.acknowledged:  # type: ignore[has-type]
            # The store script took the message out of kombu's unacked hash and index: the
            # acknowledgement below, on Celery's usual path (the event loop's turn, which also
            # lets it fetch the next message), is only kombu's bookkeeping.
            qos = getattr(self.message.channel, "qos", None)  # no channel: Celery's ack says so
            if isinstance(qos, FleetQoS):
                qos.acked_in_redis(ack.delivery_tag)
        super().acknowledge()

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
    """The Celery task of one job on one device worker (made by the bootstep per job)."""

    #: Set per job by the bootstep.
    definition: JobDefinition
    device_worker: DeviceWorker
    #: A job's own failures are expected: logged without Celery's traceback dump.
    throws = (JobError,)
    #: Kwargs are checked against the job's schema, not the function's signature.
    typing = False
    Strategy = "tasks.worker.strategy:guarded_strategy"
    Request = "tasks.worker.runner:JobRequest"
    #: The lease's take script stores STARTED (LeaseKeeper.hold), in the same round trip.
    track_started = False

    def run(self, **kwargs: Any) -> dict[str, Any]:
        return execute(self.device_worker, self, self.definition, kwargs)


def job_options(request: Any) -> JobOptions:
    """The job's options from its message header.

    Raises:
        InvalidJobArguments: the header is not valid options; the message names the bad field.
    """
    raw = (getattr(request, "headers", None) or {}).get(OPTIONS_HEADER)
    if raw is None:
        return JobOptions()
    try:
        return JobOptions.model_validate(raw)
    except ValidationError as exc:
        raise InvalidJobArguments(f"job options ({OPTIONS_HEADER} header): {describe_validation_error(exc)}") from None


def execute(worker: DeviceWorker, task: Task, definition: JobDefinition, kwargs: Any) -> dict[str, Any]:
    """Run one job under its lease and return its entry.

    Raises:
        celery.exceptions.Ignore: this job already runs on another live worker, or has finished
            (see :mod:`tasks.worker.lease`); this copy is dropped.
        Exception: the job failed; the exception carries its error entry.
    """
    if worker.leases is None or task.request.id is None:
        return _execute(worker, task, definition, kwargs)
    with worker.leases.hold(task):
        return _execute(worker, task, definition, kwargs)


def _execute(worker: DeviceWorker, task: Task, definition: JobDefinition, kwargs: Any) -> dict[str, Any]:
    started = time.time()
    job_id = str(task.request.id or f"local-{started}")
    device = worker.device.name
    output: dict[str, Any] | None = None
    failure: BaseException | None = None
    give_way: GiveWay | None = None
    recycle = False
    if worker.heartbeat is not None:
        worker.heartbeat.update(busy=BusyInfo(job=definition.name, job_id=job_id, since=started),
                                after_s=heartbeat.COALESCE_S)
    fan_out_id = str(getattr(task.request, "group", None) or job_id)
    scalar_log = ScalarLog(run_dir(worker.settings.tensorboard_path, definition.name, fan_out_id, device))
    reports = progress.ProgressPublisher(
        task, device, worker.heartbeat, worker.heartbeat.client if worker.heartbeat is not None else None,
        expires_s=worker.settings.result_expires_s,
    )
    try:
        options = job_options(task.request)
        params = validate_kwargs(definition, kwargs)
        ctx = JobContext(
            device=device,
            torch_device=worker.torch_device,
            job_id=job_id,
            artifacts_dir=worker.artifacts_path / job_id,
            cores=worker.cores,
            reporter=reports.report,
            scalar_sink=scalar_log.log,
            # Celery's revoke command adds the id to this set in the worker (the consumer
            # runs beside the job's pool thread): a set lookup per ctx.progress() call.
            cancelled=lambda: job_id in worker_state.revoked,
        )
        func = definition.func if options.gang is None else rank_of_gang(worker, definition, options.gang)
        result, recycle = run_guarded(func, ctx, params, options.fallback)
        if not isinstance(result, dict):
            raise JobError(f"job {definition.name!r} returned {type(result).__name__}, not a dict")
        json.dumps(result)  # results travel as JSON: fail here, in the entry, not in Celery
        output = result
    except OutOfMemory as exc:
        logger.warning("%s: job %s ran out of memory: %s", device, definition.name, exc)
        failure, recycle = exc, exc.recycle
    except JobCancelled as exc:
        logger.info("%s: job %s %s: %s", device, definition.name, job_id, exc)
        failure = exc
    except GiveWay as exc:
        logger.info("%s: job %s %s: %s", device, definition.name, job_id, exc)
        give_way = exc
    except DeviceFleetError as exc:
        logger.warning("%s: job %s failed: %s", device, definition.name, exc)
        failure = exc
    except Exception as exc:  # a job's own failure: reported, never fatal to the worker
        logger.exception("%s: job %s raised", device, definition.name)
        failure = exc
    finally:
        reports.flush()  # the last report always goes out: the finished bar shows 10/10
        scalar_log.close()
        worker.jobs_done += give_way is None
        if worker.heartbeat is not None:
            worker.heartbeat.update(busy=None, progress=None, jobs_done=worker.jobs_done,
                                    after_s=heartbeat.COALESCE_S)
    if give_way is not None:
        # The same message (id, chord, options) back on the queue: it runs again later.
        raise task.retry(countdown=GIVE_WAY_S, max_retries=None)
    finished = time.time()
    _finish_with_result(worker, task, definition, failure is None, started, finished, output)
    recycle_if_needed(recycle, device)
    entry = Entry.make(device=device, worker=worker.nodename, output=output,
                       error=ErrorInfo.of(failure) if failure is not None else None,
                       started=started, finished=finished, visibility=worker.seen)
    if isinstance(failure, JobCancelled):
        # Out of the except block, so the job's tensors are unreachable: the device's memory
        # is back at its baseline before the next job (a pruned trial's GPU memory included).
        release_memory(worker.torch_device)
        store_cancelled(task, failure, entry)
    if failure is not None:
        raise attach_entry(failure, entry)
    return entry.to_dict()


def rank_of_gang(worker: DeviceWorker, definition: JobDefinition, spec: GangSpec) -> JobFunc:
    """The job as one rank of the distributed job ``spec`` (:mod:`tasks.worker.distributed`).

    Raises:
        GangFailed: this worker is not joined to a fleet, or its device is not one of the gang's.
    """
    client = worker.heartbeat.client if worker.heartbeat is not None else None
    if client is None:
        raise GangFailed(f"{worker.device.name} is not joined to a fleet: a distributed job needs its Redis")
    if worker.device.name not in spec.devices:
        raise GangFailed(f"{worker.device.name} took a rank of {spec.id}, which runs on "
                         f"{', '.join(spec.devices)}: send distributed jobs with fan_out(..., distributed=True)")
    rdv = Rendezvous(client, spec, worker.device.name, host_name(), worker.settings.result_expires_s)

    def rank(ctx: JobContext, params: Any) -> dict[str, Any]:
        return run_rank(definition.func, ctx, params, rdv, worker.address)

    return rank


def store_cancelled(task: Task, failure: JobCancelled, entry: Entry) -> None:
    """End a job that stopped at ``ctx.progress()`` as Celery ends a revoked one: state
    ``REVOKED`` (what Flower and ``AsyncResult.state`` show), its chord part counted, a
    ``task-revoked`` event, and the device's cancelled entry kept with it.

    Raises:
        celery.exceptions.Ignore: always; the state is stored, Celery must store nothing more.
    """
    request = task.request
    exc = attach_entry(TaskRevokedError(str(failure)), entry)
    task.backend.store_result(request.id, exc, states.REVOKED, request=request)
    if request.chord:
        task.backend.on_chord_part_return(request, states.REVOKED, exc)
    task.send_event("task-revoked", terminated=False, signum=None, expired=False)
    raise Ignore()


def _finish_with_result(worker: DeviceWorker, task: Task, definition: JobDefinition, ok: bool,
                        started: float, finished: float, output: dict[str, Any] | None) -> None:
    """Hand the result backend what goes with the job's stored result: its lease, released, its
    counts for the fleet's metrics and its message's acknowledgement
    (:class:`~tasks.core.backend.JobFinish`): one round trip."""
    if worker.heartbeat is None:
        return
    task_id = str(task.request.id)
    leases = worker.leases
    setattr(task.request, FINISH_ATTR, JobFinish(
        device=worker.device.name,
        lease=leases.finishing(task_id) if leases is not None else None,
        ack=(getattr(task.request, "properties", None) or {}).get(STORED_ACK_ATTR),
        count=accounting.job_count(
            worker.device.name, worker.nodename, ok=ok, started=started, finished=finished,
            metrics=definition.metric_values(output), gpu_memory_bytes=accounting.gpu_memory_in_use(),
        ),
        on_stored=(lambda: leases.forget(task_id)) if leases is not None else None,
    ))


def collect(entries: list[dict[str, Any]], devices: list[str]) -> dict[str, dict[str, Any]]:
    """The chord's body: ``{device: entry}``, in the order of ``devices`` (the header's order).

    A failed device's entry is its error entry (:class:`tasks.core.backend.FleetBackend`).
    """
    out: dict[str, dict[str, Any]] = {}
    for device, entry in zip(devices, entries, strict=False):
        out[device] = {**entry, "device": device} if isinstance(entry, dict) else Entry.make(
            device=device, worker=None, output=None, started=None, finished=None,
            error=ErrorInfo(type="FanOutError", message=f"no entry from {device}: got {entry!r:.200}"),
        ).to_dict()
    return out
