"""A job's life in Redis, in one place: the Python side (:class:`JobState`) of every script that
takes, renews, finishes, releases and reaps a job's lease, and the records they are handed and
return. The scripts' Lua, with the typed records of the keys and arguments of the two largest,
is in :mod:`tasks.core.jobscripts`.

Each step is one script call through :class:`JobState`, which nothing else calls scripts for:
the device worker's lease keeper and reaper (:mod:`tasks.worker.lease`, :mod:`tasks.worker.reaper`:
the threads, and what to do with each reply) and the result backend's store (:class:`tasks.core.backend.FleetBackend`,
through which every Celery path of storing a state goes). The record a job's lease holds is
:class:`tasks.core.records.LeaseRecord`; its keys are in :mod:`tasks.core.keys`.

A job's life, one script call a step:

1. **take** (:meth:`JobState.take`, :data:`~tasks.core.jobscripts.TAKE`): unless its result is stored, the worker takes
   the job's lease ``keys.lease(task_id)`` (a TTL key, and ``{task id: lease}`` in
   ``keys.LEASES``) and stores its STARTED state. A lease held by a live owner refuses the copy
   (the job never runs twice at once); a dead owner's lease is taken over and its death counted
   (``keys.worker_deaths``); a job with ``max_attempts`` deaths is taken but not run
   (``lost``). What it takes is an :class:`Attempt`, the handle every later step of that run
   carries;
2. **renew** (:meth:`JobState.renew`, :data:`~tasks.core.jobscripts.RENEW`): the worker's lease keeper, a third of the
   TTL apart, while the job's process lives;
3. **finish** (:meth:`JobState.finish`, :data:`~tasks.core.jobscripts.STORE`): the result stored unless a finished one
   is there, with the job's :class:`JobEnd`: its attempt's lease released, its count
   (:class:`~tasks.core.jobcount.JobCount`) added to the fleet's metrics and its message
   acknowledged (:class:`MessageAck`), so a copy arriving at any moment finds the lease or the
   result;
4. **reap** (:meth:`JobState.expired_on_turn`, :meth:`JobState.expired`, :meth:`JobState.reaped`): a
   lease whose key expired with its owner dead is given back to its queue by the reaper whose
   turn it is (one look a fleet an interval), which counts the death; so
   is an orphan's, whose owner is alive but has not run the job for a while (the write that
   ended it was lost in a failover), with no death counted; **release**
   (:meth:`JobState.release`) gives a lease up without a result (a dropped copy, a retry).

The job's end crosses one seam it cannot avoid: a device worker builds it while the job's task
runs, but Celery's tracer stores the task's result afterwards, through the result backend, and
hands the backend nothing but the task's request. The end therefore rides on that request, in
one field (:data:`END_FIELD`), written by :func:`hand_over` and read by :func:`handover`, and
nowhere else. The request is the very object the tracer passes to the store and then to
``task_postrun``, so the end goes with the run that built it: a second copy of the same task
running in another thread of the process has a request of its own, and an end whose store
never comes (a worker going down) goes away with its request. (A registry keyed by task id,
the other way, would need cleaning up after every path and could hand one copy's end to
another's store.) The store records what it did on the same :class:`Handover`, where the lease
keeper reads it after the store (``task_postrun``: :meth:`tasks.worker.lease.LeaseKeeper.settle`).

Fencing: taking a lease INCRs the job's token (``keys.fence(task_id)``), a number that only
grows per job, stamped into the lease value and the STARTED state and carried by the
:class:`Attempt` (and so by every write of that attempt: its renewals, its release, its
:class:`JobEnd`). The scripts that store and release refuse a token older than the job's
current one: a worker that was cut off, whose job a newer attempt runs now, writes nothing (a
refused store is :attr:`Stored.FENCED`, which the keeper's settle sees); so does the script that
publishes its progress (:data:`~tasks.core.jobscripts.PROGRESS`). A worker that stopped
its job itself, cut off (self-fencing, :mod:`tasks.worker.fence`), reports it
(:meth:`JobState.fenced`): the reaper and the take count no death for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from . import keys
from .defaults import BLACKHOLE_WINDOW_S, CAP_AUDIT_KEEP
from .jobcount import JobCount
from .jobscripts import (
    EXPIRED_LEASES,
    FENCED,
    PROGRESS,
    REAPED,
    RELEASE,
    RENEW,
    STORE,
    TAKE,
    UNSTAMPED_LEASE,
    StoreArgs,
    StoreKeys,
    TakeArgs,
    TakeKeys,
)
from .records import LeaseRecord
from .transport import acked_in_redis


def stamp_lease(value: str, token: int) -> str:
    """Lease value ``value`` as the take script stores it with fencing token ``token``."""
    return f'{{"token":{token}{value.removeprefix(UNSTAMPED_LEASE)}' if value.startswith(UNSTAMPED_LEASE) else value


def _pairs(reply: list[bytes]) -> dict[str, str]:
    """``{task id: lease record}`` of :data:`~tasks.core.jobscripts.EXPIRED_LEASES`' flat reply."""
    return {bytes_to_str(task_id): bytes_to_str(raw) for task_id, raw in zip(reply[::2], reply[1::2], strict=True)}


def _token(value: str | bytes | None) -> int | None:
    """The fencing token a lease value carries (its first field, stamped by the take script)."""
    if value is None:
        return None
    text = bytes_to_str(value)
    head, _, _ = text.removeprefix('{"token":').partition(",")
    try:
        return int(head)
    except ValueError:  # unstamped or not a lease: no attempt holds it
        return None


@dataclass(frozen=True)
class Attempt:
    """One run of a job under its lease: the handle :meth:`JobState.take` returns, and what
    renewing, releasing and storing the job's end take."""

    task_id: str
    #: The lease key's value (its :class:`~tasks.core.records.LeaseRecord` as JSON, with its
    #: token): a script renews, releases or deletes a lease only while it is still this one.
    lease: str
    #: The attempt's fencing token: issued by the take, it only grows per job; the scripts that
    #: store, release or publish refuse a token older than the job's current one.
    token: int = 0
    #: Taken over its user's cap, as borrowed work (:mod:`tasks.core.caps`): preemptible by any
    #: work that waits for its device.
    borrowed: bool = False


class Took(str, Enum):
    """What the take script found (:data:`~tasks.core.jobscripts.TAKE`)."""

    #: Taken: run the job.
    OK = "ok"
    #: Taken, but the job has taken its worker down ``max_attempts`` times: do not run it.
    LOST = "lost"
    #: Its result is stored: do not run it.
    FINISHED = "finished"
    #: Another lease is there.
    HELD = "held"
    #: Another lease is recorded, its key expired (its owner dead, or late to renew).
    EXPIRED = "expired"
    #: The lease we meant to replace was replaced by another meanwhile.
    CHANGED = "changed"
    #: The taker's device is out of service (drained, quarantined, suspect): nothing taken.
    OUT = "out"
    #: Its user (or team) holds its cap of the device's kind: not taken (:mod:`tasks.core.caps`).
    CAPPED = "capped"


@dataclass(frozen=True)
class TakeReply:
    """The take script's reply: with :attr:`Took.OK` and :attr:`Took.LOST` the :class:`Attempt`
    now held, with :attr:`Took.LOST` the workers the job took down (oldest first), with
    :attr:`Took.HELD` and :attr:`Took.EXPIRED` the lease record found there."""

    status: Took
    attempt: Attempt | None = None
    holder: str | None = None
    lost_to: tuple[str, ...] = ()
    #: With :attr:`Took.OUT`: the device's state.
    out: str = ""
    #: With :attr:`Took.CAPPED`, why: ``alice: 1/1 cpu (cap), borrowing off``.
    capped: str | None = None
    #: With :attr:`Took.OK` and :attr:`Took.LOST`: taken over its user's cap, as borrowed work.
    borrowed: bool = False


@dataclass(frozen=True)
class StateMeta:
    """A task's state as Celery stores it: its meta key, the encoded meta, and how long it is
    kept in seconds (0: for ever)."""

    key: str
    value: str | bytes
    expires_s: int


@dataclass(frozen=True)
class MessageAck:
    """A job's message, acknowledged by the script that stores the job's end: kombu's unacked
    hash and index (its channel's names, :func:`tasks.core.transport.stored_ack_keys`) and the
    message's delivery tag. The channel's acknowledgement that follows is then only kombu's
    bookkeeping (:func:`tasks.core.transport.acked_in_redis`)."""

    unacked_key: str
    unacked_index_key: str
    delivery_tag: str


@dataclass(frozen=True)
class JobEnd:
    """What goes with a job's finished state, in the one script call that stores it: built by
    one builder (:func:`tasks.worker.accounting.job_end`) on every path a job ends by (it ran,
    failed, crashed or was cancelled; it was refused: invalid options, lost; it is unknown).

    Attributes:
        attempt: the lease to release if it is still this attempt's; ``None``: no lease.
        count: the job's figures for the fleet's metrics; ``None``: not counted.
        ack: the job's message, acknowledged in the same call; ``None``: Celery acknowledges it.
    """

    attempt: Attempt | None = None
    count: JobCount | None = None
    ack: MessageAck | None = None
    #: The shared queue the job came from ('' for its device's own, or none): the store records
    #: where that queue's jobs end ok (a black hole's evidence: :data:`tasks.core.device_state.FAILED_FAST`).
    shared_queue: str = ""


class Stored(str, Enum):
    """What the store script did (:data:`~tasks.core.jobscripts.STORE`)."""

    #: The state is stored; with a :class:`JobEnd`, its lease released, its count added and
    #: its message acknowledged.
    STORED = "stored"
    #: A final state was there: nothing stored or counted; the end's lease released and its
    #: message acknowledged all the same.
    FINAL_THERE = "final state there"
    #: Refused: the end's attempt has an older token than the job's (a newer attempt holds it,
    #: this one was cut off): nothing written.
    FENCED = "fenced"


# -- the seam: a job's end, from the worker's run to the result backend's store ------------------

#: The one field of a Celery task request that carries a job's :class:`Handover` (see the
#: module's docstring); written by :func:`hand_over`, read by :func:`handover` only.
END_FIELD = "devicefleet_end"


@dataclass
class Handover:
    """A job's end handed to the store of its finished state, and what that store did
    (``None`` until it ran: it failed, or has not come yet) and whether a replica had it."""

    end: JobEnd
    stored: Stored | None = None
    #: Whether a replica had the store (:class:`tasks.core.sentinel.Replication`; always with
    #: none asked for): False, it is not done, and the job may run again after a failover.
    confirmed: bool = True


def hand_over(request: Any, end: JobEnd) -> Handover:
    """Hand ``end`` to the store of the finished state of the task whose request is
    ``request`` (the tracer's, or any request a store is then called with)."""
    handed = Handover(end)
    setattr(request, END_FIELD, handed)
    return handed


def handover(request: Any) -> Handover | None:
    """The job's end handed with ``request`` (:func:`hand_over`), if any."""
    handed = getattr(request, END_FIELD, None)
    return handed if isinstance(handed, Handover) else None


# -- the interface ---------------------------------------------------------------------------------


class JobState:
    """A job's life in Redis through ``client``: each method is one script call (one round trip),
    called by hash (EVALSHA: each script's text is sent once per connection pool)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._take = client.register_script(TAKE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)
        self._store = client.register_script(STORE)
        self._expired = client.register_script(EXPIRED_LEASES)
        self._reaped = client.register_script(REAPED)
        self._fenced = client.register_script(FENCED)
        self._progress = client.register_script(PROGRESS)

    def take(self, record: LeaseRecord, ttl_ms: int, *, started: StateMeta | None = None, replace: str = "",
             dead: str = "", max_attempts: int = 0, keep_s: int = 0, device: str = "") -> TakeReply:
        """Take the lease of ``record.task_id`` as ``record`` for ``ttl_ms`` and, with
        ``started``, store the job's STARTED state, unless the job's result is stored.

        ``replace``: the lease expected there ('' takes a free lease only; else the lease key's
        value or, when that key has expired, the value recorded in ``keys.LEASES``); ``dead``:
        the dead owner of that lease, whose death is counted (kept ``keep_s`` seconds, 0: for
        ever); ``max_attempts``: the deaths after which the job is taken but not run (0: no
        bound); ``device``: the taker's, refused while out of service ('' for no check). See
        :data:`~tasks.core.jobscripts.TAKE`."""
        task_id = record.task_id
        value, lent = record.to_json(), record.model_copy(update={"borrowed": True}).to_json()
        reply = self._take(
            keys=TakeKeys(meta=started.key if started else "", lease=keys.lease(task_id), leases=keys.LEASES,
                          deaths=keys.worker_deaths(task_id), fence=keys.fence(task_id),
                          fenced=keys.fenced(task_id), caps=keys.CAPS, cap_audit=keys.CAP_AUDIT,
                          device_state=keys.DEVICE_STATE if device else "").values(),
            args=TakeArgs(value=value, borrowed_value=lent, ttl_ms=ttl_ms, task_id=task_id,
                          started=started.value if started else "",
                          started_expires_s=started.expires_s if started else 0, replace=replace, dead=dead,
                          max_attempts=max_attempts, keep_s=keep_s, user=record.user or "", device=record.device,
                          lease_prefix=keys.lease(""), audit_keep=CAP_AUDIT_KEEP, service_device=device).values(),
        )
        status = Took(bytes_to_str(reply[0]))
        if status is Took.OUT:
            return TakeReply(status, out=bytes_to_str(reply[1]))
        if status in (Took.HELD, Took.EXPIRED):
            return TakeReply(status, holder=bytes_to_str(reply[1]))
        if status is Took.CAPPED:
            return TakeReply(status, capped=bytes_to_str(reply[1]))
        if status in (Took.OK, Took.LOST):
            token, borrowed = int(reply[-2]), bool(int(reply[-1]))
            attempt = Attempt(task_id, stamp_lease(lent if borrowed else value, token), token, borrowed)
            return TakeReply(status, attempt=attempt,
                             lost_to=tuple(bytes_to_str(name) for name in reply[1]) if status is Took.LOST else (),
                             borrowed=borrowed)
        return TakeReply(status)

    def renew(self, attempt: Attempt, ttl_ms: int, *, restore: bool) -> bool:
        """Renew ``attempt``'s lease for ``ttl_ms`` (and, with ``restore``, write it again if a
        Redis restart lost it); False if another worker's lease is there (left alone) or a newer
        attempt has a token."""
        return bool(self._renew(keys=[keys.lease(attempt.task_id), keys.LEASES, keys.fence(attempt.task_id)],
                                args=[attempt.lease, ttl_ms, attempt.task_id, "1" if restore else "", attempt.token]))

    def release(self, attempt: Attempt) -> bool:
        """Give ``attempt``'s lease up without a result, if it is still this attempt's (a worker
        that was cut off must not delete its successor's). False if its token is older than
        the job's (refused)."""
        return bool(self._release(keys=[keys.lease(attempt.task_id), keys.LEASES, keys.fence(attempt.task_id)],
                                  args=[attempt.lease, attempt.task_id, attempt.token]))

    def finish(self, task_id: str, meta: StateMeta, end: JobEnd | None, *, final: bool) -> Stored:
        """Store task ``task_id``'s state ``meta`` unless a final one is stored and, with a job's
        ``end``, release its lease, count it and acknowledge its message (:data:`~tasks.core.jobscripts.STORE`).
        ``final``: every finished state is final (a devicefleet job), else only SUCCESS is
        (Celery's rule). Idempotent: run again (after a failover), it finds its state stored."""
        end = end or JobEnd()
        count, ack = end.count, end.ack
        device = count.device if count is not None else ""
        stored = self._store(
            keys=StoreKeys(meta=meta.key, lease=keys.lease(task_id), leases=keys.LEASES, stats=keys.stats(device),
                           stats_devices=keys.STATS_DEVICES, finished=keys.finished(device),
                           unacked=ack.unacked_key if ack else "", unacked_index=ack.unacked_index_key if ack else "",
                           fence=keys.fence(task_id), usage=keys.USAGE, user_seconds=keys.USER_SECONDS,
                           fast_failures=keys.fast_failures(device),
                           queue_ok=keys.queue_ok(end.shared_queue) if end.shared_queue else "").values(),
            args=StoreArgs(meta=meta.value, expires_s=meta.expires_s, lease=end.attempt.lease if end.attempt else "",
                           task_id=task_id, count=count.script_arg() if count is not None else "",
                           delivery_tag=ack.delivery_tag if ack else "", final="1" if final else "",
                           token=end.attempt.token if end.attempt else "", window_s=BLACKHOLE_WINDOW_S).values(),
        )
        if int(stored) < 0:
            return Stored.FENCED
        if ack is not None:
            acked_in_redis(ack.delivery_tag)
        return Stored.STORED if int(stored) else Stored.FINAL_THERE

    def lease_tokens(self, task_ids: list[str]) -> list[int | None]:
        """The fencing token of each job's lease now (``None``: no lease: it expired, was
        released or reaped), one ``MGET``: what a distributed job's ranks read of each other's
        (:class:`tasks.worker.gang.GangWatch`)."""
        if not task_ids:
            return []
        raw = self.client.mget([keys.lease(task_id) for task_id in task_ids])
        return [_token(value) for value in raw]

    def progress(self, attempt: Attempt, meta: StateMeta, report: str, expires_s: int, device: str) -> bool:
        """Publish ``attempt``'s progress ``report`` (JSON) and its PROGRESS state ``meta``
        (:data:`~tasks.core.jobscripts.PROGRESS`); False if a newer attempt holds the job (refused, counted)."""
        task_id = attempt.task_id
        return bool(self._progress(
            keys=[meta.key, keys.progress(task_id), keys.fence(task_id), keys.stats(device), keys.STATS_DEVICES],
            args=[meta.value, meta.expires_s, report, expires_s, attempt.token, device]))

    def expired(self) -> dict[str, str]:
        """``{task id: lease record}`` of the leases whose key is gone: the reaper's candidates,
        whose owner may still be alive (late to renew)."""
        return _pairs(self._expired(keys=[keys.LEASES], args=[keys.lease("")]))

    def expired_on_turn(self, token: str, turn_ms: int) -> dict[str, str] | None:
        """:meth:`expired` if it is reaper ``token``'s turn (:data:`~tasks.core.keys.REAPER_TURN`),
        taken or kept for ``turn_ms`` from now in the same call; None if another reaper's turn is
        running (one ``GET``, no scan): one look a fleet a reaper's interval, not one a worker."""
        reply = self._expired(keys=[keys.LEASES, keys.REAPER_TURN], args=[keys.lease(""), token, turn_ms])
        return None if reply is None else _pairs(reply)

    def reaped(self, task_id: str, raw: str, dead: str, keep_s: int) -> bool:
        """The reaper gave back job ``task_id`` whose lease record read ``raw``: remove the
        record if it is still that one and count ``dead``'s death ('' for an orphan: none),
        kept ``keep_s`` seconds (0: for ever). True if the record was removed."""
        return bool(self._reaped(keys=[keys.LEASES, keys.REAPER_STATS, keys.worker_deaths(task_id),
                                       keys.fenced(task_id)],
                                 args=[task_id, raw, dead, keep_s]))

    def fenced(self, task_id: str, device: str, note: str, keep_s: int) -> int:
        """Report that ``device``'s worker named ``note`` (``"<worker> pid <pid>"``) stopped job
        ``task_id`` itself, cut off from Redis (:data:`~tasks.core.jobscripts.FENCED`): no death is counted for it, and
        one a reaper counted meanwhile is taken back. Returns how many were taken back."""
        return int(self._fenced(keys=[keys.fenced(task_id), keys.worker_deaths(task_id), keys.REAPER_STATS,
                                      keys.stats(device), keys.STATS_DEVICES],
                                args=[note, keep_s, device]))
