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

The job itself runs in a job process (:mod:`tasks.worker.supervisor`); a job's life here is a
short chain (:func:`execute`): read its options, take its lease, run it in the run mode its
options call for (:mod:`tasks.worker.modes`: plain, a gang's rank, a device group) while a
:class:`JobWatch` publishes its progress and says when to stop it, then one ``match`` on the
run's :class:`~tasks.worker.supervisor.Ended` (:func:`settle`): its end handed (the lease's
attempt, the count and the acknowledgement: :func:`tasks.worker.accounting.job_end`) to the
store of its result (:meth:`JobRun.end`), which Celery's tracer makes once the task returns or
raises (:class:`tasks.worker.lease.LeaseKeeper` settles the lease after it); or nothing stored
(fenced); or its message back on its queue (preempted, given way).
"""

from __future__ import annotations

import builtins
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, NoReturn, assert_never

import redis
from billiard.einfo import ExceptionWithTraceback
from celery import Task, states
from celery.exceptions import Ignore, TaskRevokedError
from celery.utils.serialization import create_exception_cls, get_pickled_exception
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.utils.encoding import safe_repr
from pydantic import ValidationError

from ..core import errors
from ..core.backend import attach_entry
from ..core.defaults import (
    CAP_RETRY_S,
    GIVE_WAY_S,
    HEALTH_STOP_GRACE_S,
    HEARTBEAT_COALESCE_S,
    MEMORY_WRITE_S,
    PLACEMENT_HAND_BACKS,
)
from ..core.errors import (
    DeviceMismatch,
    InvalidJobArguments,
    JobCancelled,
    NoJobAccount,
    OutOfMemory,
    UserNotVerified,
    WorkerLost,
)
from ..core.job import JobMetric
from ..core.jobcount import count_preemption
from ..core.jobstate import Attempt, hand_over
from ..core.keys import FRONT_HEADER, OPTIONS_HEADER, PREEMPTIONS_HEADER, SIGNATURE_HEADER
from ..core.priority import Level
from ..core.queue_lists import split_level
from ..core.queues import device_queue, key_device
from ..core.records import BusyInfo, Entry, ErrorInfo, JobOptions
from ..core.validation import describe_validation_error
from ..core.wire import JobInfo, ModeMessage, Outcome, Proceed, RunJob, StopJob, StopReason
from . import accounting, blackhole, group, progress
from .device import DeviceWorker
from .launch import Launch
from .lease import OutOfService, deaths_kept_s
from .slots import Slot
from .supervisor import Ended

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
    #: end (preempted, given way, unpacked, held back by its cap, handed back by a device out of
    #: service, a black hole's first fast failure): never a failure, so never bounded.
    #: (``retry(max_retries=None)`` means the task's bound, Celery's default 3: a job handed back
    #: a 4th time failed as MaxRetriesExceededError.)
    max_retries = None

    def run(self, **kwargs: Any) -> dict[str, Any]:
        return execute(self.device_worker, self, self.job, kwargs)


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


def verified_options(worker: DeviceWorker, request: Any) -> JobOptions:
    """The job's options (:func:`job_options`) with its user verified: ``options.user`` is the
    user whose credentials sent the job (:class:`tasks.core.users.UserKeys`; on a fleet with no
    users, the name the job gives, as before). The one place a worker learns who a job is for.

    Raises:
        InvalidJobArguments: the options are invalid.
        UserNotVerified: the job names a user whose credentials did not send it.
        NoJobAccount: under job accounts, the job's user has none here (or the fleet does not know them).
    """
    options = job_options(request)
    if request.id is None:  # called in process: no message, nobody to verify
        return options
    headers = getattr(request, "headers", None) or {}
    problem = worker.user_keys.check(worker.client, str(request.id), options.user, headers.get(SIGNATURE_HEADER))
    if problem is not None:
        raise UserNotVerified(f"job {request.id} refused: {problem}")
    accounts = worker.supervisor.accounts
    if accounts is not None:  # a user's job runs only as the account of a user the fleet verified
        refusal = accounts.refusal(options.user, verified=worker.user_keys.knows(options.user))
        if refusal is not None:
            raise NoJobAccount(f"job {request.id} refused: {refusal}")
    return options


def execute(worker: DeviceWorker, task: Task, job: JobInfo, kwargs: Any) -> dict[str, Any]:
    """Run one job under its lease and return its entry.

    Raises:
        celery.exceptions.Ignore: this job already runs on another live worker, or has finished
            (see :mod:`tasks.worker.lease`); this copy is dropped.
        Exception: the job failed (its options are invalid, it took its worker down
            ``max_attempts`` times: ``WorkerLost``, or it ran and failed); the exception carries
            its error entry, and its failure is stored with its message acknowledged.
    """
    try:
        options = verified_options(worker, task.request)
    except (InvalidJobArguments, UserNotVerified, NoJobAccount) as exc:  # refused before it takes anything: there is nothing to run
        return JobRun(worker, task, job).end(failed=exc)
    if options.constraints is not None and task.request.id is not None:
        mismatch = _mismatch(worker, task, options)
        if mismatch is None and options.group is not None:  # the group's other devices too
            mismatch = _group_mismatch(worker, options)
        if mismatch is not None:
            if options.gang is not None:  # its peers end now, naming it, not after their join timeout
                worker.modes.gang.refuse(options.gang, str(mismatch))
            return JobRun(worker, task, job).end(failed=mismatch)
    if task.request.id is None:  # called in process, not from a message: nothing to lease
        return _execute(worker, task, job, kwargs, options)
    if worker.health is not None and (failed := worker.health.failed) is not None:
        # The device failed (drained: its service watch stops the consumer): a job sent to it
        # by name ends at once, one taken from a shared queue meanwhile goes back to it.
        if sent_by_name(task.request, worker.device.name):
            return JobRun(worker, task, job).end(failed=errors.DeviceFailed(
                f"job {task.request.id} was not run: {worker.device} failed ({failed.reason}) and was drained"))
        if worker.health.on_failed is not None:  # the service watch, woken should it not have read the drain yet
            worker.health.on_failed(failed)
        raise task.retry(countdown=0, max_retries=None)
    if options.group is not None:  # its leader reserves the group's devices: it waits at no gate
        return _leased(worker, task, job, kwargs, options)
    job_id = str(task.request.id)
    if worker.modes.pack.rooms.room_of(job_id) is not None:  # a pack's member: its leader passed the gate
        return _leased(worker, task, job, kwargs, options)
    with worker.gate.single(job_id, lambda: worker.stopping_since is not None or job_id in worker_state.revoked,
                            options.priority) as admitted:
        if admitted:
            return _leased(worker, task, job, kwargs, options)
    if job_id in worker_state.revoked:  # cancelled while a group held the device: it never ran
        return JobRun(worker, task, job).end(ended=Ended.by_worker(
            JobCancelled, f"job {job_id} on {worker.device} was cancelled before it started", pid=0,
            retired=None, outcome=Outcome.CANCELLED))
    # The worker stops while a group holds the device: the message goes back to the queue.
    raise task.retry(countdown=GIVE_WAY_S, max_retries=None)


def _mismatch(worker: DeviceWorker, task: Task, options: JobOptions) -> DeviceMismatch | None:
    """None when this device meets the job's constraints. The producer sent the job only where
    they held; a device that changed since (restarted with other labels) never runs it: one taken
    from a shared queue goes back to it for a matching device (this worker's own record is read,
    no Redis), one sent here by name gets its error entry.

    Raises:
        celery.exceptions.Retry: the job is handed back to its shared queue.
    """
    assert options.constraints is not None
    why = options.constraints.why_not(worker.heartbeat.record)
    if not why:
        return None
    queue = split_level(str((task.request.delivery_info or {}).get("routing_key") or ""))[0]
    handed_back = int(task.request.retries or 0)
    if queue != device_queue(worker.device.name) and handed_back < PLACEMENT_HAND_BACKS:
        logger.info("job %s asks for %s; %s: %s; handing it back to %s", task.request.id,
                    options.constraints.describe(), worker.device.name, why, queue)
        raise task.retry(countdown=GIVE_WAY_S, max_retries=PLACEMENT_HAND_BACKS)
    after = f" (handed back {handed_back} times: no matching device took it)" if handed_back else ""
    return DeviceMismatch(f"{worker.device.name} does not meet the job's constraints "
                          f"{options.constraints.describe()}: {why}; it did not run{after}")


def _group_mismatch(worker: DeviceWorker, options: JobOptions) -> DeviceMismatch | None:
    """None when each device of the job's group meets its constraints
    (:func:`tasks.worker.group.refused_members`); else the group's devices are let go."""
    assert options.group is not None and options.constraints is not None
    why = group.refused_members(worker.client, options.group, worker.device.name, options.constraints)
    if not why:
        return None
    group.let_go(worker.client, options.group)
    return DeviceMismatch(f"group {options.group.name}: not every device meets the job's constraints "
                          f"{options.constraints.describe()}: {why}; it did not run")


def _leased(worker: DeviceWorker, task: Task, job: JobInfo, kwargs: Any, options: JobOptions) -> dict[str, Any]:
    with ExitStack() as held:
        try:
            attempt = held.enter_context(worker.leases.hold(task, max_attempts=options.max_attempts,
                                                                     user=options.user))
        except WorkerLost as exc:  # only the lease's refusal, never a job's own error of that name
            return JobRun(worker, task, job).end(failed=exc)
        except OutOfService as exc:
            hand_back(worker, task, f"its device is {exc}")
        return _execute(worker, task, job, kwargs, options, attempt)


def _execute(worker: DeviceWorker, task: Task, job: JobInfo, kwargs: Any, options: JobOptions,
             attempt: Attempt | None = None) -> dict[str, Any]:
    room = worker.modes.pack.rooms.room_of(str(task.request.id)) if task.request.id is not None else None
    if room is not None:  # a pack's member runs in its leader's slot, which makes way for it as a whole
        run = JobRun(worker, task, job, None, options)
        watch = JobWatch(worker, task, run.job_id, options, room.slot.index, attempt, preemptible=False)
        return _run(worker, task, run, watch, Launch(
            message=run.job_message(kwargs, options, attempt), options=options, watch=watch, slot=room.slot,
            token=attempt.token if attempt is not None else 0))
    with worker.slots.take() as slot:
        run = JobRun(worker, task, job, slot, options)
        watch = JobWatch(worker, task, run.job_id, options, slot.index, attempt)
        siblings = (functools.partial(worker.siblings.take, task, level=options.priority)
                    if options.pack is not None and task.request.id is not None else None)
        return _run(worker, task, run, watch, Launch(
            message=run.job_message(kwargs, options, attempt), options=options, watch=watch, slot=slot,
            token=attempt.token if attempt is not None else 0, on_start=run.start_clock, siblings=siblings))


def _run(worker: DeviceWorker, task: Task, run: JobRun, watch: JobWatch, launch: Launch) -> dict[str, Any]:
    """Run ``launch`` in the mode its options choose, then settle its ending."""
    options = launch.options
    preemption = worker.preemption if watch.preemptible else None
    if preemption is not None:
        lent = watch.attempt is not None and watch.attempt.borrowed and options.user is not None
        preemption.running(run.job_id, options.priority,
                           borrowed=(str(options.user), worker.device.kind.value) if lent else None)
    try:
        ended = worker.modes.of(options).run(launch)
    finally:
        if preemption is not None:
            preemption.done(run.job_id)
        # Every report relayed before the job's end is stored (a fenced job's are left).
        watch.drain()
    return settle(worker, task, run, ended)


def settle(worker: DeviceWorker, task: Task, run: JobRun, ended: Ended) -> dict[str, Any]:
    """Hand ``run``'s ending on, by its outcome: its entry stored (returned, or raised with its
    failure), nothing stored (fenced: its lease expires and the job is given back), or its
    message back on its queue (preempted: at once, at the front; given way: later).

    Raises:
        celery.exceptions.Ignore: it was fenced off, or cancelled (REVOKED stored with its end).
        celery.exceptions.Retry: it made way for higher-level work, or gave its device to an
            older gang or group: its message goes back to the queue.
        Exception: it failed; the exception carries its error entry.
    """
    match ended.outcome:
        case Outcome.FENCED:
            # Cut off from Redis, it stopped the job itself: no result of this attempt may be
            # stored; its lease expires, the reaper gives the job back, and no death is counted.
            run.idle(done=False)
            worker.leases.fenced(run.job_id, deaths_kept_s(task.app))
            raise Ignore()
        case Outcome.PREEMPTED:
            # It made way (or was ended for it after its grace): back to its queue, not a failure.
            run.idle(done=False)
            requeue_preempted(worker, task, run.job_id, ended.stop.level if ended.stop is not None else None,
                              borrowed=worker.leases.borrowed(run.job_id))
        case Outcome.UNPACK:
            # Its pack could not finish it (the pack's process died): back to its queue at once,
            # to run alone, so a trial that kills its process kills only itself the next time.
            run.idle(done=False)
            worker.leases.release(run.job_id)
            headers = dict(task.request.headers or {})
            alone = job_options(task.request).model_copy(update={"pack": None}).to_dict()
            raise task.retry(countdown=0, max_retries=None, headers={**headers, OPTIONS_HEADER: alone})
        case Outcome.GIVE_WAY:
            # The same message (id, chord, options) back on the queue: it runs again later.
            run.idle(done=False)
            raise task.retry(countdown=GIVE_WAY_S, max_retries=None)
        case Outcome.DEVICE_FAILED if sent_by_name(task.request, worker.device.name):
            # Sent to this device and no other: its entry says the device failed, at once (its
            # process may have crashed first on the failing GPU: the device's failure is why).
            return run.end(failed=errors.DeviceFailed(ended.stop.message) if ended.stop is not None else None,
                           ended=ended)
        case Outcome.DEVICE_FAILED:
            # Its device failed under it (and is drained: it takes nothing new): back to its
            # shared queue at once, its lease released (no attempt spent, no death counted).
            run.idle(done=False)
            logger.warning("job %s on %s: %s; back to its queue", run.job_id, worker.device,
                           ended.error.message if ended.error is not None else "its device failed")
            worker.leases.release(run.job_id)
            raise task.retry(countdown=0, max_retries=None)
        case Outcome.ERROR if blackhole.judged(worker, ended, run.options, task.request, run.run_s(ended)) and \
                blackhole.decide(worker, task.request, ended):
            # Its first fast failure on this device, from a shared queue: not stored, back to the
            # end of its queue, no attempt spent (tasks.worker.blackhole).
            run.idle(done=False)
            worker.leases.release(run.job_id)
            raise task.retry(countdown=0, max_retries=None)
        case Outcome.OK | Outcome.ERROR | Outcome.CANCELLED | Outcome.PEER_LOST:
            return run.end(ended=ended)
        case _:
            assert_never(ended.outcome)


def sent_by_name(request: Any, device: str) -> bool:
    """Whether the job of ``request`` came from ``device``'s own queue (``device.<name>``, at
    any level), not a queue the device shares with others."""
    queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    return isinstance(queue, str) and split_level(queue)[0] == device_queue(device)


def requeue_preempted(worker: DeviceWorker, task: Task, job_id: str, level: Level | None,
                      borrowed: bool = False) -> NoReturn:
    """Send a preempted job's message back to its queue (:mod:`tasks.worker.preemption`): the
    same id, kwargs, options and chord, its count of preemptions one more, at the front of its
    level's list (:data:`~tasks.core.keys.FRONT_HEADER`), so it keeps its place among its level:
    it runs before the work of its level sent after it. Its lease is released first (no death
    counted: it was not lost), so the worker that takes it next takes it at once. A job that ran
    ``borrowed`` (over its user's cap, :mod:`tasks.core.caps`) made way for work of its own
    level, which its user's list could come before (users go least usage first): it comes back
    :data:`~tasks.core.defaults.CAP_RETRY_S` later, at the back, so the freed slot takes that work.

    Raises:
        celery.exceptions.Retry: always; Celery acknowledges this message and stores no end.
    """
    headers = dict(task.request.headers or {})
    count = preemptions_of(task.request) + 1
    logger.info("job %s on %s made way for %s work (preemption %d): back to its queue", job_id,
                worker.device, level.value if level is not None else "higher-level", count)
    worker.leases.release(job_id)
    try:
        count_preemption(worker.client, worker.device.name)
    except redis.RedisError as exc:  # a figure only: the job goes back all the same
        logger.warning("could not count the preemption of job %s: %s", job_id, exc)
    if borrowed:
        raise task.retry(countdown=CAP_RETRY_S, max_retries=None, headers={**headers, PREEMPTIONS_HEADER: count})
    raise task.retry(countdown=0, max_retries=None,
                     headers={**headers, PREEMPTIONS_HEADER: count, FRONT_HEADER: True})


def hand_back(worker: DeviceWorker, task: Task, why: str) -> NoReturn:
    """Send a job's message back to the front of its queue, not run here (its device went out of
    service: :mod:`tasks.worker.service`): no attempt spent, no death counted, its lease (if it
    held one) released first; the device's consumer stops taking, so another device takes it.

    Raises:
        celery.exceptions.Retry: always; Celery acknowledges this message and stores no end.
    """
    job_id = str(task.request.id)
    logger.info("job %s on %s goes back to its queue: %s", job_id, worker.device, why)
    worker.leases.release(job_id)
    if worker.service is not None:
        worker.service.wake()  # stop the consumer now: the next message would come back here
    raise task.retry(countdown=0, max_retries=None, headers={**dict(task.request.headers or {}), FRONT_HEADER: True})


def preemptions_of(request: Any) -> int:
    """How many times the job of ``request`` was preempted before (its message's header)."""
    value = (getattr(request, "headers", None) or {}).get(PREEMPTIONS_HEADER, 0)
    return value if isinstance(value, int) and value >= 0 else 0


class JobWatch:
    """What a running job's supervisor asks of the worker: publish a report or a command's log
    lines (the job process has no door to Redis: the worker relays them); stop it now?

    A job stops when the producer cancelled it (Celery's revoke adds its id to the worker's
    ``revoked`` set), when it is past its time limit, when higher-level work waits for its
    device (:mod:`tasks.worker.preemption`), when the worker is stopping and the job has had
    its stop timeout, or when its worker fences itself off it (its lease has gone unconfirmed
    too long, or a newer attempt took it: :meth:`tasks.worker.lease.LeaseKeeper.must_stop`).
    :meth:`stop` only answers which stop is due; :meth:`act_on` does what sending it takes
    (a preemption's claim on the message it makes way for). The stop sent travels into the
    run's :class:`~tasks.worker.supervisor.Ended`, whose outcome :func:`settle` matches on.
    """

    def __init__(self, worker: DeviceWorker, task: Task, job_id: str, options: JobOptions, slot: int = 0,
                 attempt: Attempt | None = None, preemptible: bool = True) -> None:
        self.worker = worker
        #: The attempt that holds the job's lease (``None``: run under none): its reports carry its token.
        self.attempt = attempt
        self.task = task
        self.slot = slot
        # Celery's task.request is per thread: keep this job's.
        self.request = task.request
        self.job_id = job_id
        self.time_limit_s = options.time_limit_s or float(worker.config.max_job_seconds)
        self.deadline = time.monotonic() + self.time_limit_s
        self._client = worker.client
        #: Set once a self-fencing stop is sent (:meth:`act_on`): the job's reports are a newer
        #: attempt's business now, and its Redis may be out of reach (:meth:`drain` waits for none).
        self._fenced = threading.Event()
        self.level = options.priority
        # Not a group's job (its devices would have to stop as a whole), nor a job run in process
        # without a message to send back. A gang's rank is: its gang stops as a whole
        # (tasks.worker.gang.GangWatch tells every rank).
        # Work taken over its user's cap (borrowed) is always preemptible: that is its terms.
        borrowed = attempt is not None and attempt.borrowed
        self.preemptible = preemptible and (options.preemptible or borrowed) and options.group is None \
            and attempt is not None
        self.started = time.monotonic()
        self._reports: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._relay: threading.Thread | None = None

    def report(self, fields: dict[str, Any]) -> None:
        """Relay a report, in order, from a thread of its own: the supervisor's loop never waits
        on Redis (a cut-off worker's relay retries for minutes, and the job's stop must not)."""
        if len(self.worker.slots) > 1:  # which of the device's jobs it is (Flower's progress column)
            fields = {**fields, "slot": self.slot}
        if self._relay is None:
            self._relay = threading.Thread(target=self._relay_reports, name=f"devicefleet-reports-{self.slot}",
                                           daemon=True)
            self._relay.start()
        self._reports.put(fields)

    def _relay_reports(self) -> None:
        while (fields := self._reports.get()) is not None:
            if self._fenced.is_set():  # a newer attempt's reports are the job's now
                continue
            published = progress.publish(self.task, self.request, fields, self.worker.heartbeat, self._client,
                                         self.worker.settings.result_expires_s, self.slot, self.attempt,
                                         self.worker.device.name)
            if not published:  # a newer attempt runs the job: this one stops (stop() asks the keeper)
                self.worker.leases.superseded(self.job_id)

    def drain(self) -> None:
        """End the relay of reports, once every report is relayed; a fenced job's are left
        (their relay gives up with its retries)."""
        if self._relay is None:
            return
        self._reports.put(None)
        if not self._fenced.is_set():
            self._relay.join()

    def log(self, lines: Sequence[tuple[str, str]]) -> None:
        progress.publish_log(self._client, self.job_id, lines, self.worker.settings.result_expires_s)

    def heard(self, message: ModeMessage) -> Proceed | None:
        """A plain job has no gang: nothing to publish or fail, nothing to answer."""
        return None

    def memory(self, used: int) -> None:
        # Folded into the next write: the samples come often.
        self.worker.heartbeat.update_slot(self.slot, memory_bytes=used, after_s=MEMORY_WRITE_S)

    def stop(self) -> StopJob | None:
        where = f"job {self.job_id} on {self.worker.device}"
        leases = self.worker.leases
        if (why := leases.must_stop(self.job_id)) is not None:
            return StopJob(job_id=self.job_id, reason=StopReason.FENCED, message=f"{where}: {why}",
                           grace_s=leases.fence_grace_s)
        health = self.worker.health
        if health is not None and (failed := health.failed) is not None:
            return StopJob(job_id=self.job_id, reason=StopReason.DEVICE_FAILED, grace_s=HEALTH_STOP_GRACE_S,
                           message=f"{where}: the device failed ({failed.reason}); it was drained")
        if self.job_id in worker_state.revoked:
            return StopJob(job_id=self.job_id, reason=StopReason.CANCEL, message=f"{where} was cancelled")
        if time.monotonic() > self.deadline:
            return StopJob(job_id=self.job_id, reason=StopReason.TIMEOUT,
                           message=f"{where} ran past its time limit of {self.time_limit_s:g} s")
        return self.slot_stop()

    def slot_stop(self) -> StopJob | None:
        where = f"job {self.job_id} on {self.worker.device}"
        preemption = self.worker.preemption
        if self.preemptible and preemption is not None and \
                (waiting := preemption.outranked(self.job_id, self.level, self.started)) is not None:
            return StopJob(job_id=self.job_id, reason=StopReason.PREEMPT, grace_s=self.worker.config.preempt_grace_s,
                           level=waiting, message=f"{where} ({self.level.value}) made way for {waiting.value} work "
                                                  f"waiting for the device; it goes back to its queue and runs again")
        service = self.worker.service
        if self.preemptible and service is not None and service.hand_back_now:
            return StopJob(job_id=self.job_id, reason=StopReason.PREEMPT, grace_s=self.worker.config.preempt_grace_s,
                           message=f"{where}: its device was drained now ({service.state.reason}); it goes back "
                                   "to its queue and runs again elsewhere")
        if worker_state.should_stop is not None or worker_state.should_terminate is not None:
            self.worker.begin_stop()  # a signal's warm shutdown, before the jobs step hears of it
        if self.worker.stopping_since is not None:
            timeout = self.worker.stop_timeout_s
            if time.monotonic() - self.worker.stopping_since > timeout:
                return StopJob(job_id=self.job_id, reason=StopReason.SHUTDOWN,
                               message=f"{where}: the worker is stopping and the job did not end "
                                       f"within its stop timeout of {timeout:g} s")
        return None

    def act_on(self, stop: StopJob) -> StopJob | None:
        if stop.reason is StopReason.FENCED:
            self._fenced.set()
            logger.error("%s", stop.message)
        elif stop.reason is StopReason.PREEMPT and stop.level is not None:
            # One job per waiting message, across the fleet: the claim decides which one.
            preemption = self.worker.preemption
            if preemption is None or preemption.claim(self.job_id, self.level, self.started) is None:
                return None
        return stop


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

    def end(self, ended: Ended | None = None, failed: BaseException | None = None) -> dict[str, Any]:
        """Hand the job's end to the store of its result (:func:`~tasks.core.jobstate.hand_over`:
        Celery's tracer stores what this returns or raises, with the end, in one script call)
        and return its entry.

        Raises:
            celery.exceptions.Ignore: it was cancelled (REVOKED is stored here, with the end).
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
    device's cancelled entry kept with it.

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
