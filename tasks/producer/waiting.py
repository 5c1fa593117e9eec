"""Why is my job waiting: the fleet's queued jobs, by level and user, each with its place.

::

    import tasks
    for job in tasks.waiting():          # in the order they will start, highest level first
        print(job.level, job.user, job.job, job.position, job.reason)

A queued job is a message in one of the lists a worker consumes (:mod:`tasks.core.priority`).
:func:`waiting` reads the lists the live workers consume (each level's list of the queues their
registry records name) and the lists
of running sweeps (``sweep.<id>`` and their levels), decodes each message's headers (the job,
its :class:`~tasks.core.records.JobOptions`: level and user) and places it: its ``position`` is
one more than the number of messages a device that consumes its list would take before it
(every list it takes first, all of them, and the messages ahead in its own), on the device
where that number is least. The lists of one level take turns (:class:`tasks.core.transport.LevelCycle`):
the other lists of its level are counted as if all came first, so the position is an upper
bound. Its ``reason`` says what it waits for: its user's (or team's) cap when it holds it
(``alice: 4/4 gpu (cap), borrowing off``, :mod:`tasks.core.caps`), the jobs ahead (by level),
and what the devices that could take it run now. A fan-out's collect steps are bookkeeping:
counted ahead, never listed.

Within a level a free device serves users by their usage (:mod:`tasks.core.fairshare`):
:func:`read_fair_share` gives each user's usage and share, in that order.

Read with a fleet user's credentials, it lists her own jobs only, each placed behind every
job ahead of it, hers or not (the ACL lets a user read the lengths of every list, and the
messages of her own).

Reads only: one ``HGETALL`` of the caps (and, when some are set, of the leases, with one
pipelined ``EXISTS`` per lease), one pipelined ``ZRANGE`` of the users waiting beside each level
list, one ``LLEN`` per list, one ``LRANGE`` of at most :data:`WAITING_READ_LIMIT`
messages per non-empty list (the next ones to start), one ``SCAN`` for sweep lists.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery
from pydantic import BaseModel, ConfigDict, ValidationError

from ..core import keys
from ..core.caps import blocking, kind_of, read_cap_uses
from ..core.defaults import WAITING_READ_LIMIT
from ..core.fairshare import order_users, read_usage
from ..core.job import COLLECT_TASK, TASK_PREFIX
from ..core.priority import Level
from ..core.queue_lists import (
    brpop_keys,
    count_waiting,
    insert_in_level,
    leveled,
    queue_rank,
    split_level,
    split_user,
    waiting_users,
)
from ..core.queues import SWEEP_QUEUE_PREFIX
from ..core.records import JobOptions, SweepRecord, WorkerRecord, stored
from ..core.registry import live_workers
from .connections import Connections, default_app

__all__ = ["WaitingJob", "by_level_and_user", "fair_share", "read_fair_share", "read_waiting", "waiting"]


class WaitingJob(BaseModel):
    """One queued job: what it is, who sent it, where it waits and why."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    job: str
    level: Level
    user: str | None
    #: The queue list it waits in (``device.cpu0:urgent``, ``cpu``, ``sweep.s1:batch``): its user's
    #: list beside it in Redis (``device.cpu0:urgent~alice``, :mod:`tasks.core.fairshare`).
    queue: str
    #: The devices that consume that list.
    devices: list[str]
    #: 1: the next job its best device takes.
    position: int
    #: Why it waits, in a sentence.
    reason: str
    #: When it was sent (the sender's clock; None if its message does not say).
    sent_at: float | None = None
    #: What it asks of a device (``min_memory_gib=40 label.nvlink=true``: :mod:`tasks.core.placement`);
    #: ``devices`` are then the consumers that meet it. None: any consumer.
    constraints: str | None = None


def waiting(app: Celery | None = None, *, client: Connections | None = None) -> list[WaitingJob]:
    """The fleet's queued jobs, by position (see the module's docstring)."""
    connections = client or Connections.of(app or default_app())
    return read_waiting(connections.redis)


def fair_share(app: Celery | None = None, *, client: Connections | None = None) -> dict[str, dict[str, float]]:
    """Each user's usage and share now, least first (:func:`read_fair_share`)."""
    connections = client or Connections.of(app or default_app())
    return read_fair_share(connections.redis)


def by_level_and_user(jobs: list[WaitingJob]) -> dict[str, dict[str, int]]:
    """``{level: {user: jobs waiting}}``, levels highest first."""
    out: dict[str, dict[str, int]] = {}
    for level in Level:
        users = Counter(job.user or "?" for job in jobs if job.level is level)
        if users:
            out[level.value] = dict(sorted(users.items()))
    return out


def read_fair_share(client: redis.Redis, now: float | None = None) -> dict[str, dict[str, float]]:
    """``{user: {"usage_s", "share"}}``: each user's usage now (device-seconds decayed over the
    half-life, :mod:`tasks.core.fairshare`) and its share of all users' (0 to 1); least first,
    the order a free device serves them in within a level. One ``HGETALL``."""
    usage = read_usage(client, now)
    total = sum(usage.values())
    return {user: {"usage_s": usage[user], "share": usage[user] / total if total else 0.0}
            for user in order_users(usage, usage)}


def read_waiting(client: redis.Redis) -> list[WaitingJob]:
    """:func:`waiting` on a Redis client (``decode_responses`` either way)."""
    live = live_workers(client)
    orders = {device: leveled(record.queues) for device, record in live.items()}
    for name, devices in _sweep_lists(client).items():
        name = split_user(name)[0]
        for device in devices:
            if device in orders and name not in orders[device]:
                insert_in_level(orders[device], name)  # an attached sweep's list: kombu adds it last
    # Each level's waiting users' lists after its queue lists, users by usage (what a worker's
    # read names: the users waiting beside each list, not every user ever seen).
    beside = waiting_users(client, sorted({name for order in orders.values() for name in order}))
    users = order_users({user for listed in beside.values() for user in listed}, read_usage(client))
    orders = {device: [key for key, _queue in brpop_keys(order, users, beside=beside)] for device, order in orders.items()}
    names = sorted({name for order in orders.values() for name in order})
    depths = dict(zip(names, count_waiting(client, names), strict=True))
    busy_text = {device: _busy_text(record) for device, record in live.items()}
    caps, uses = read_cap_uses(client)
    jobs: list[WaitingJob] = []
    for name in (n for n in names if depths[n]):
        consumers = [device for device, order in orders.items() if name in order]
        raw = _messages(client, name)
        for ahead_here, item in enumerate(reversed(raw)):  # kombu pops from the right: next first
            message = _decode(item)
            if message is None:
                continue
            options: JobOptions = message["options"]
            # A placed job waits for the consumers that meet its constraints (the others hand it back).
            able = consumers if options.constraints is None else \
                [d for d in consumers if options.constraints.matches(live[d])]
            ahead = min((_ahead(orders[d], name, depths, ahead_here) for d in able or consumers),
                        key=lambda pair: pair[0])
            user = options.user
            capped = [use.line() for kind in sorted({kind_of(d) for d in able or consumers})
                      for use in blocking(caps, uses, user, kind)]
            reason = _reason(ahead, split_level(name)[1], able, busy_text)
            asked = options.constraints.describe() if options.constraints is not None else None
            if asked:
                reason = f"it asks for a device with {asked}: {reason}"
            jobs.append(WaitingJob(
                job_id=message["id"], job=message["job"], level=options.priority,
                user=user, queue=split_user(name)[0], devices=able, position=ahead[0] + 1,
                reason="; ".join([*capped, reason] if reason else capped),
                sent_at=message["sent_at"], constraints=asked,
            ))
    jobs.sort(key=lambda job: (job.level.rank, job.position, job.queue, job.user or ""))
    return jobs


def _messages(client: redis.Redis, name: str) -> list[Any]:
    """The next :data:`WAITING_READ_LIMIT` messages of list ``name``, or none where the reader
    may not read them: a fleet user reads her own lists' messages, and only the lengths of the
    rest (:func:`tasks.core.users.acl_rules`), which still count ahead of hers."""
    try:
        return list(client.lrange(name, -WAITING_READ_LIMIT, -1))
    except redis.exceptions.NoPermissionError:
        return []


def _sweep_lists(client: redis.Redis) -> dict[str, list[str]]:
    """``{sweep list: devices}`` of every non-empty ``sweep.<id>`` list (its sweep's devices)."""
    found: dict[str, list[str]] = {}
    for raw in client.scan_iter(match=f"{SWEEP_QUEUE_PREFIX}*", count=1000, _type="list"):
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        base, _level = split_level(name)
        try:
            record = client.get(keys.sweep(base.removeprefix(SWEEP_QUEUE_PREFIX)))
            found[name] = stored(SweepRecord, record).devices if record else []
        except (ValidationError, redis.exceptions.NoPermissionError):  # another user's sweep
            found[name] = []
    return found


def _ahead(order: list[str], name: str, depths: Mapping[str, int], in_list: int) -> tuple[int, Counter[Level]]:
    """Messages a device with queue ``order`` may take before the ``in_list``-th of list ``name``
    (0: its next), in all and by level: every message of a higher level, and of the other lists
    of its level (they take turns with it: an upper bound)."""
    by_level: Counter[Level] = Counter()
    rank = queue_rank(name)
    for queue in order:
        if queue != name and depths.get(queue) and queue_rank(queue) <= rank:
            by_level[split_level(queue)[1]] += depths[queue]
    if in_list:
        by_level[split_level(name)[1]] += in_list
    return sum(by_level.values()), by_level


def _reason(ahead: tuple[int, Counter[Level]], level: Level, devices: list[str],
            busy_text: Mapping[str, str | None]) -> str:
    total, by_level = ahead
    if not devices:
        return "no live worker consumes its queue"
    parts = []
    if total:
        counts = ", ".join(f"{by_level[lvl]} {lvl.value}" for lvl in Level if by_level[lvl])
        parts.append(f"{total} job{'s' if total != 1 else ''} ahead of it ({counts})")
    busy = [f"{d}: {text}" for d in devices if (text := busy_text.get(d))]
    if len(busy) == len(devices):
        parts.append("every device that can take it is busy (" + "; ".join(busy) + ")")
    elif not total:
        parts.append("a device is free: it starts next")
    return "; ".join(parts)


def _busy_text(record: WorkerRecord) -> str | None:
    """``hold (normal, bob)`` for each slot's running job; None when a slot is free."""
    running = [slot.busy for slot in record.slots if slot.busy is not None]
    if not record.slots or len(running) < len(record.slots):
        return None
    return ", ".join(f"{busy.job} ({busy.level.value}, {busy.user or '?'})" for busy in running)


def _decode(item: Any) -> dict[str, Any] | None:
    """The job id, job name, options and send time of a queued kombu message (None: not a job)."""
    try:
        headers = json.loads(item)["headers"]
        task = headers["task"]
        if task == COLLECT_TASK or not task.startswith(TASK_PREFIX):
            return None
        options = JobOptions.model_validate(headers.get(keys.OPTIONS_HEADER) or {})
        sent = headers.get(keys.SENT_AT_HEADER)
        return {"id": str(headers["id"]), "job": task.removeprefix(TASK_PREFIX), "options": options,
                "sent_at": float(sent) if isinstance(sent, (int, float)) else None}
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError):
        return None

