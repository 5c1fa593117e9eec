"""A job's admission on its worker: every check before it runs, each ending in :class:`Admitted`
or a :data:`~tasks.worker.disposition.Disposition` (:func:`admit`).

In order: its options and user (:func:`verified_options`: invalid, or refused, it ends failed);
its constraints on this device (:func:`device_mismatch`: handed back to a shared queue, or
failed) and its run mode's own (``mode.admit``: a group's other devices, a gang's peers told);
this device's health (drained: back to its queue, or failed when sent here by name); the gate a
device group closes (``mode.gated``: a group's leader and a pack's member wait at none); its
lease (:func:`of_lease`: taken, or dropped, redelivered, held back by its cap, handed back by a
device out of service, or lost).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from celery import Task
from celery.worker import state as worker_state
from pydantic import ValidationError

from ..core import errors
from ..core.defaults import CAP_RETRY_S, GIVE_WAY_S, PLACEMENT_HAND_BACKS
from ..core.errors import DeviceMismatch, InvalidJobArguments, JobCancelled, NoJobAccount, UserNotVerified
from ..core.jobstate import Attempt
from ..core.keys import OPTIONS_HEADER, SIGNATURE_HEADER
from ..core.queue_lists import split_level
from ..core.queues import device_queue
from ..core.records import JobOptions
from ..core.validation import describe_validation_error
from ..core.wire import Outcome
from .device import DeviceWorker
from .disposition import Disposition, Drop, Redeliver, Requeue, Store
from .lease import Take, Taken
from .modes import RunMode
from .supervisor import Ended

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admitted:
    """The job runs here, in ``mode``, with ``options``; ``attempt`` holds its lease (None: run
    in process, under none)."""

    options: JobOptions
    mode: RunMode
    attempt: Attempt | None = None
    #: Sent to this device by name (its own queue): it could have run nowhere else.
    by_name: bool = False


def admit(worker: DeviceWorker, task: Task, held: ExitStack) -> Admitted | Disposition:
    """Whether the job of ``task``'s message runs here (:class:`Admitted`, its lease held), or
    where its message goes instead. What the job holds while it runs (its pass through the gate,
    its lease's run) is entered into ``held``, which the caller leaves once it is disposed of."""
    try:
        options = verified_options(worker, task.request)
    except (InvalidJobArguments, UserNotVerified, NoJobAccount) as exc:  # refused before it takes anything
        return Store(failed=exc)
    mode = worker.modes.of(options)
    request = task.request
    if request.id is None:  # called in process, not from a message: nothing to check or lease
        return Admitted(options, mode)
    if options.constraints is not None:
        mismatch = device_mismatch(worker, task, options)
        if isinstance(mismatch, Requeue):
            return mismatch
        if (refused := mode.admit(options, mismatch)) is not None:
            return Store(failed=refused)
    job_id, by_name = str(request.id), sent_by_name(request, worker.device.name)
    if worker.health is not None and (failed := worker.health.failed) is not None:
        # The device failed (drained: its service watch stops the consumer): a job sent to it
        # by name ends at once, one taken from a shared queue meanwhile goes back to it.
        if by_name:
            return Store(failed=errors.DeviceFailed(
                f"job {job_id} was not run: {worker.device} failed ({failed.reason}) and was drained"))
        if worker.health.on_failed is not None:  # the service watch, woken should it not have read the drain yet
            worker.health.on_failed(failed)
        return Requeue()
    if mode.gated(job_id) and not held.enter_context(worker.gate.single(
            job_id, lambda: worker.stopping_since is not None or job_id in worker_state.revoked, options.priority)):
        return _shut_out(worker, job_id)
    taken = worker.leases.hold(task, max_attempts=options.max_attempts, user=options.user)
    if (elsewhere := of_lease(worker, job_id, taken)) is not None:
        return elsewhere
    held.enter_context(worker.leases.running(job_id))
    return Admitted(options, mode, taken.attempt, by_name)


def _shut_out(worker: DeviceWorker, job_id: str) -> Disposition:
    """A job the gate a device group closed did not let through."""
    if job_id in worker_state.revoked:  # cancelled while a group held the device: it never ran
        return Store(ended=Ended.by_worker(
            JobCancelled, f"job {job_id} on {worker.device} was cancelled before it started", pid=0,
            retired=None, outcome=Outcome.CANCELLED))
    # The worker stops while a group holds the device: the message goes back to the queue.
    return Requeue(delay_s=GIVE_WAY_S)


def of_lease(worker: DeviceWorker, job_id: str, taken: Taken) -> Disposition | None:
    """Where the message goes when its lease was not taken (None: it was)."""
    match taken.outcome:
        case Take.TAKEN if taken.attempt is not None:
            return None
        case Take.CAPPED:  # its user holds its cap of this device's kind: taken again later
            return Requeue(delay_s=CAP_RETRY_S)
        case Take.LOST if taken.error is not None:  # it took its worker down max_attempts times
            return Store(failed=taken.error)
        case Take.OUT_OF_SERVICE:
            # Not run here: back to the front of its queue, no attempt spent, no death counted;
            # the device's consumer stops taking now, so another device takes it.
            if worker.service is not None:
                worker.service.wake()
            return Requeue(front=True, release_lease=True, why=f"its device is {taken.out}")
        case Take.UNCONFIRMED:
            # Given back by kombu on whichever primary the channel reaches (on a new one, where
            # the message still is, back to its queue); the job is not started.
            return Redeliver(f"job {job_id}: no replica confirmed its lease")
        case _:  # another live worker runs it, or it has finished: this copy is dropped
            return Drop()


def device_mismatch(worker: DeviceWorker, task: Task, options: JobOptions) -> DeviceMismatch | Requeue | None:
    """None when this device meets the job's constraints. The producer sent the job only where
    they held; a device that changed since (restarted with other labels) never runs it: one taken
    from a shared queue goes back to it for a matching device (this worker's own record is read,
    no Redis), one sent here by name gets its error entry."""
    assert options.constraints is not None
    why = options.constraints.why_not(worker.heartbeat.record)
    if not why:
        return None
    queue = split_level(str((task.request.delivery_info or {}).get("routing_key") or ""))[0]
    handed_back = int(task.request.retries or 0)
    if queue != device_queue(worker.device.name) and handed_back < PLACEMENT_HAND_BACKS:
        logger.info("job %s asks for %s; %s: %s; handing it back to %s", task.request.id,
                    options.constraints.describe(), worker.device.name, why, queue)
        return Requeue(delay_s=GIVE_WAY_S, max_retries=PLACEMENT_HAND_BACKS)
    after = f" (handed back {handed_back} times: no matching device took it)" if handed_back else ""
    return DeviceMismatch(f"{worker.device.name} does not meet the job's constraints "
                          f"{options.constraints.describe()}: {why}; it did not run{after}")


def sent_by_name(request: Any, device: str) -> bool:
    """Whether the job of ``request`` came from ``device``'s own queue (``device.<name>``, at
    any level), not a queue the device shares with others."""
    queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    return isinstance(queue, str) and split_level(queue)[0] == device_queue(device)


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
