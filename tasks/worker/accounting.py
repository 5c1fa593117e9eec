"""A job's end as this worker stores it: the one builder of :class:`~tasks.core.jobstate.JobEnd`.

Every path a job ends by builds its end here (:func:`job_end`): it ran (ok, failed, crashed,
out of memory, past its time limit), it was cancelled, it was refused before running (invalid
options, or lost: it took its worker down ``max_attempts`` times), or no worker runs it (an
unknown job, :mod:`tasks.worker.consumer`). The end goes with the job's finished state, in the
script call that stores it (:meth:`tasks.core.jobstate.JobState.finish`): the lease this
process holds for the job, released; the job's count for the fleet's metrics
(:class:`~tasks.core.jobcount.JobCount`, added to counters in Redis that survive a worker
restart and need no event stream, so they are exact; :mod:`tasks.ops.exporter` reads them); and
its message's acknowledgement. What a job's output adds to the count is what the job declared
(``@job(..., metrics=...)``), never a field name this module knows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from celery import Celery

from ..core.caps import kind_of
from ..core.errors import ConfigError
from ..core.fairshare import share_arg, wait_arg
from ..core.job import JobMetric
from ..core.jobcount import JobCount
from ..core.jobstate import JobEnd, MessageAck
from ..core.keys import OPTIONS_HEADER, SENT_AT_HEADER, SIGNATURE_HEADER
from ..core.priority import DEFAULT_LEVEL, USER_PATTERN, Level, parse_level
from ..core.queue_lists import split_level
from ..core.queues import device_queue
from ..core.transport import stored_ack_keys
from .device import DeviceWorker

logger = logging.getLogger(__name__)


def job_end(
    worker: DeviceWorker,
    app: Celery,
    request: Any,
    *,
    ok: bool,
    started: float,
    finished: float,
    metrics: Mapping[JobMetric, float] | None = None,
    gpu_memory_bytes: int | None = None,
    shared_by: int = 1,
    busy_s: float | None = None,
) -> JobEnd:
    """The end of the job whose task request is ``request`` on ``worker``: the attempt this
    process holds for it (handed to the store, which releases its lease), its count, and its
    message's acknowledgement (``None`` when the message did not come through the fleet's
    transport, or was rejected already).

    Args:
        app: the worker's app, whose broker names the hash and index to acknowledge in.
        ok: whether the job succeeded (counted as ``jobs_ok``, else ``jobs_error``).
        metrics: the job's declared metrics: counters are added, gauges kept as ``last_<name>``.
        shared_by: how many jobs shared its slot the whole time (a pack's members): its busy
            seconds, and its user's device-seconds for fair share, are its share of the time.
        busy_s: seconds its job process kept its cores busy (measured on CPU devices): its
            user's busy time in ``devicefleet usage`` (:mod:`tasks.ops.usage`).
    """
    user, level, sent_at = _sender(request)
    user = _verified(worker, request, user)
    busy = max(0.0, finished - started) / max(1, shared_by)
    kind = kind_of(worker.device.name)
    count = JobCount(device=worker.device.name, ok=ok, worker=worker.nodename,
                     busy_seconds=busy, last_finished_at=finished,
                     gpu_memory_bytes=gpu_memory_bytes, metrics=dict(metrics or {}),
                     share=share_arg(user, level, busy, finished, kind=kind, busy_s=busy_s if kind == "cpu" else None),
                     wait=wait_arg(level, started - sent_at if sent_at is not None else None))
    return JobEnd(attempt=worker.leases.finishing(str(request.id)), count=count, ack=message_ack(app, request),
                  shared_queue=shared_queue(request, worker.device.name))


def shared_queue(request: Any, device: str) -> str:
    """The queue the job of ``request`` came from when other devices consume it too (its kind's,
    ``fleet``, a sweep's), without its level; '' for the device's own queue (a job sent to the
    device by name) or none."""
    queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    if not isinstance(queue, str) or not queue:
        return ""
    name = split_level(queue)[0]
    return "" if name == device_queue(device) else name


def _sender(request: Any) -> tuple[str | None, Level, float | None]:
    """The user, level and send time of a request's job, from its headers (a header that does
    not parse counts as none: the job's end is counted all the same)."""
    headers = getattr(request, "headers", None) or {}
    options = headers.get(OPTIONS_HEADER) or {}
    user = options.get("user") if isinstance(options, dict) else None
    try:
        level = parse_level(options.get("priority", DEFAULT_LEVEL)) if isinstance(options, dict) else DEFAULT_LEVEL
    except ConfigError:
        level = DEFAULT_LEVEL
    sent = headers.get(SENT_AT_HEADER)
    return (user if isinstance(user, str) and re.fullmatch(USER_PATTERN, user) else None, level,
            float(sent) if isinstance(sent, (int, float)) else None)


def _verified(worker: DeviceWorker, request: Any, user: str | None) -> str | None:
    """``user``, if the job of ``request`` was sent with their credentials (or the fleet has no
    users: :meth:`tasks.core.users.UserKeys.check`), else None: a job refused because it names a
    user who did not send it (``UserNotVerified``), or an unknown job that does, is counted to
    no user. The worker's cached keys: no round trip per job."""
    if user is None or request.id is None:
        return user
    headers = getattr(request, "headers", None) or {}
    problem = worker.user_keys.check(worker.client, str(request.id), user, headers.get(SIGNATURE_HEADER))
    return user if problem is None else None


def message_ack(app: Celery, request: Any) -> MessageAck | None:
    """How the store script acknowledges the message of ``request`` (its delivery tag, on the
    app's broker), or ``None``: the broker's channels cannot be acknowledged in by a script, or
    the request came with no message (an unknown job's, rejected already)."""
    tag = (request.properties or {}).get("delivery_tag")
    names = stored_ack_keys(app.conf)
    if names is None or not isinstance(tag, str):
        return None
    return MessageAck(unacked_key=names[0], unacked_index_key=names[1], delivery_tag=tag)
