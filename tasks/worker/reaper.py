"""The reaper: a dead worker's jobs, and orphaned ones, go back to their queues fast.

Celery's Redis transport returns an unacknowledged message only after ``visibility_timeout``
(an hour). Every running job holds a lease (:mod:`tasks.worker.lease`) that its worker renews;
a :class:`Reaper` thread (in every worker) looks, on its turn, at each recorded lease whose key
has expired and whose owner is not alive in the fleet registry, and
gives the message back to the front of its queue with the transport's own
``QoS.restore_by_tag``, which also removes it from kombu's ``unacked`` hash so the transport
does not restore it a second time an hour later. If the message is gone from Redis (a dropped
duplicate copy acknowledged its delivery tag), the job is sent again from its lease record
(:func:`resend_job`). The turn (:data:`~tasks.core.keys.REAPER_TURN`, one reaper's for an interval
from its last look, taken or kept in the look's script call: :meth:`JobState.expired_on_turn`) makes one look a
fleet an interval, not one a worker: the look reads every lease, so a look a worker would cost
Redis devices x running jobs; another reaper's tick costs one ``GET``. A Redis lock lets one
reaper reap at a time.

A lease can also be orphaned: its owner is alive but no longer runs the job, and the write that
ended it (the stored result, which releases the lease and acknowledges the message) is gone, lost
with a Redis primary that died before a replica had it (README "On Redis Sentinel"). Its owner
neither renews it (it forgot it) nor restores it, so its key expires, and nothing else would
give the job back before kombu's visibility timeout. The reaper gives such a lease back too,
without counting a death, once its owner's registry record, fresh, says the owner runs no such
job and the lease has stayed so for :attr:`Orphans.grace_s` (:class:`Orphans`): an owner that
held it would have restored its key within a third of the lease TTL of reaching Redis.

Each dead owner's death is counted against its job (:meth:`tasks.core.jobstate.JobState.reaped`,
in the script call that removes the dead lease), so a job that keeps taking its worker down is
given up (:mod:`tasks.worker.lease`). A job stopped by its worker's self-fencing
(:mod:`tasks.worker.fence`) is given back the same way, and the stop its worker reports takes the
death back.

Recovery from a killed worker therefore takes about ``max(lease_ttl_s, heartbeat_ttl_s) +
reaper_interval_s``, whatever the job's length, while any worker lives: a dead reaper's turn
expires an interval after its last look.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis
from celery import Celery
from redis.exceptions import LockError

from ..core import keys
from ..core.jobstate import JobState
from ..core.periodic import PeriodicThread
from ..core.records import ResendRecord, WorkerRecord
from .lease import death_note, deaths_kept_s, live_owner, parse_lease

logger = logging.getLogger(__name__)


def runs_job(owner: WorkerRecord, task_id: str) -> bool:
    """Whether ``owner``'s record says one of its slots runs job ``task_id``."""
    return any(slot.busy is not None and slot.busy.job_id == task_id for slot in owner.running)


class Orphans:
    """The expired leases a reaper has seen with a live owner that does not run their job, and
    since when (see the module's docstring): one is due to be given back once it has stayed so,
    the same lease record, for ``grace_s``.

    A reaper looks on its turns only, but while it watches one (:attr:`pending`) it looks every
    tick, its turn or not (:meth:`Reaper.tick`): the grace must be seen whole, in looks an interval
    apart, or a lease its owner renewed, then let expire again, between two looks turns apart
    would seem orphaned all along and go back early. One is given back all the same: some reaper
    has the turn every interval, sees it, and from then looks every tick until its grace ends."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._seen: dict[str, tuple[str, float]] = {}

    def due(self, task_id: str, raw: str) -> bool:
        now = time.monotonic()
        seen = self._seen.get(task_id)
        if seen is None or seen[0] != raw:
            self._seen[task_id] = (raw, now)
            return False
        return now - seen[1] >= self.grace_s

    @property
    def pending(self) -> bool:
        """Whether an orphan is watched: its reaper must look every tick."""
        return bool(self._seen)

    def keep(self, task_ids: set[str]) -> None:
        """Forget every lease but ``task_ids`` (the expired ones of this round)."""
        for task_id in set(self._seen) - task_ids:
            del self._seen[task_id]


def reap_once(client: redis.Redis, app: Celery, orphans: Orphans | None = None) -> list[str]:
    """Give back to their queues the jobs whose lease expired with their owner dead, and count
    each owner's death against its job (:meth:`JobState.reaped`); with ``orphans``, also those whose
    owner is alive but has not run them for ``orphans.grace_s`` (no death counted).

    A broker connection is opened only when there is such a job. Returns the task ids given back.
    """
    restored: list[str] = []
    conn = None
    jobs = JobState(client)
    keep_s = deaths_kept_s(app)
    expired = jobs.expired()
    if orphans is not None:
        orphans.keep(set(expired))
    try:
        for task_id, raw in expired.items():
            record = parse_lease(raw)
            if record is None:
                client.hdel(keys.LEASES, task_id)
                continue
            dead = death_note(record)
            owner = live_owner(client, record)
            if owner is not None:
                # Alive and late to renew (Redis was away): it renews on its next beat. Unless
                # it has not run the job for a while: the write that ended the job was lost.
                if orphans is None or runs_job(owner, task_id) or not orphans.due(task_id, raw):
                    continue
                dead = ""
                logger.warning("job %s: its lease expired %g s ago or more and its owner %s (pid %s), alive, "
                               "does not run it: the write that ended it was lost (a Redis failover?); "
                               "giving it back", task_id, orphans.grace_s, record.worker, record.pid)
            if conn is None:
                conn = app.connection_for_write()
            qos = conn.default_channel.qos
            tag = record.delivery_tag
            if tag and client.hexists(qos.unacked_key, tag):
                # Back to the front of its queue, and out of kombu's unacked hash and index.
                qos.restore_by_tag(tag, leftmost=False)
            elif record.resend is not None:
                # The message is gone from Redis (a dropped duplicate copy acknowledged its
                # delivery tag): send the job again, same id, chord and group, from the lease.
                resend_job(app, task_id, record.resend)
            else:
                logger.error("job %s of dead worker %s cannot be given back: its message is gone",
                             task_id, record.worker)
            # After the message is back (a round cut short gives it back again, never loses it).
            jobs.reaped(task_id, raw, dead, keep_s)
            if dead:
                logger.warning("job %s of dead worker %s (pid %s) given back to its queue",
                               task_id, record.worker, record.pid)
            restored.append(task_id)
    finally:
        if conn is not None:
            conn.release()
    return restored


def resend_job(app: Celery, task_id: str, resend: ResendRecord) -> None:
    """Send a job again from its lease record: same task id, kwargs, queue, headers, chord, group."""
    app.send_task(
        resend.name, kwargs=resend.kwargs, task_id=task_id, queue=resend.queue, headers=resend.headers,
        chord=resend.chord, group_id=resend.group_id, group_index=resend.group_index,
        root_id=resend.root_id, parent_id=resend.parent_id,
    )


class Reaper(PeriodicThread):
    """Looks for expired leases every ``interval_s`` when it is its turn (one reaper's a fleet
    for ``interval_s``: :meth:`JobState.expired_on_turn`, ``token`` its own) and, when there are
    some, runs :func:`reap_once`; redis-py's ``Lock`` keeps it to one reaper at a time.

    An orphaned lease (a live owner that does not run its job) is given back once this reaper
    has seen it so for ``orphan_grace_s`` (default: twice ``lease_ttl_s``, in which an owner that
    held it would have restored it six times)."""

    name = "devicefleet-reaper"

    def __init__(self, client: redis.Redis, app: Celery, interval_s: float, orphan_grace_s: float,
                 token: str = "") -> None:
        super().__init__(interval_s)
        self.token = token or uuid.uuid4().hex
        self._turn_ms = max(1, round(interval_s * 1000))
        self._client = client
        self._jobs = JobState(client)
        self._app = app
        self.orphans = Orphans(orphan_grace_s)
        # Held for one round at most; a reaper that dies holding it frees it by expiry.
        self._lock_timeout_s = max(1.0, interval_s * 5)

    def tick(self) -> None:
        # One round trip in the usual case, another's turn or nothing to reap: the lock only when
        # there is. Watching an orphan, it looks on others' turns too (Orphans).
        expired = self._jobs.expired_on_turn(self.token, self._turn_ms)
        if expired is None and self.orphans.pending:
            expired = self._jobs.expired()
        if expired is None:
            return
        if not expired:
            self.orphans.keep(set())
            return
        lock = self._client.lock(keys.REAPER_LOCK, timeout=self._lock_timeout_s, blocking=False)
        if not lock.acquire():
            return
        try:
            reap_once(self._client, self._app, self.orphans)
        finally:
            try:
                lock.release()
            except LockError:  # the round outlasted the lock: another reaper may hold it now
                pass
