"""Self-fencing: when a job must stop because its lease may go to another worker.

A worker cut off from Redis (a network partition) is not dead, and its job must not run on
beside the copy the reaper (:mod:`tasks.worker.reaper`) gives to another worker. So a job whose
lease Redis has not confirmed for :attr:`Fence.fence_after_s` (a part of the TTL,
:data:`tasks.core.defaults.FENCE_AFTER_TTL`), measured on this process's monotonic clock from
the time the last confirmed renewal (or the take) was *sent*, is to be stopped
(:meth:`Fence.must_stop`, which the job's watch asks; its stop has :attr:`Fence.fence_grace_s`)
before its lease can expire and go to another worker; so is one whose lease a newer attempt took
(a renewal found it taken, or a write of its attempt was refused: every write carries the
attempt's fencing token, which the scripts of :mod:`tasks.core.jobstate` refuse once a newer
attempt took the job).

On a fleet with replicas, confirmed means a replica had it too (Redis's ``WAIT``,
:class:`~tasks.core.sentinel.Replication`): a primary cut off from its replicas still confirms
renewals that a failover drops, while the promoted replica's copy of the lease expires from the
last renewal it had; the job stops from that one, before the copy can go to another worker.

The rule rests on two assumptions: the clocks of this host and Redis's run at rates that differ
by far less than the margin left (the TTL less both), and this process is never paused (SIGSTOP,
a VM migration, swapping) for longer than that margin. While Redis refuses connections (no
redis-server there: a restart) nothing is stopped: Redis gives the lease to no one meanwhile, and
the keeper restores it once Redis is back.

Once stopped (:meth:`Fence.stopped`), the lease is left to expire (the keeper never renews,
releases or restores it) and the stop is reported to Redis as soon as it can be reached
(:meth:`Fence.report`, :meth:`tasks.core.jobstate.JobState.fenced`): the reaper gives the job
back and no death is counted for it.

The :class:`Fence` holds no lease: the lease keeper (:class:`tasks.worker.lease.LeaseKeeper`)
tells it what Redis confirmed, and asks it which jobs to leave alone.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from ..core.defaults import FENCE_AFTER_TTL, FENCE_GRACE_TTL
from ..core.jobstate import JobState

logger = logging.getLogger(__name__)


class Fence:
    """What Redis last confirmed of each lease a worker process holds, and which of its jobs
    must stop (see the module's docstring). Thread-safe; no method makes a round trip but
    :meth:`report`."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_ms = int(ttl_s * 1000)
        #: How long a lease may go unconfirmed before its job is stopped, and the stop's grace.
        self.fence_after_s = ttl_s * FENCE_AFTER_TTL
        self.fence_grace_s = ttl_s * FENCE_GRACE_TTL
        # task id -> monotonic time the last renewal Redis confirmed was sent (or the take)
        self._confirmed: dict[str, float] = {}
        self._taken_over: set[str] = set()  # task ids whose lease a newer attempt holds
        self._reports: dict[str, int] = {}  # task id -> deaths kept s: stops to report to Redis
        # Whether the last renewal found Redis refusing connections (its process down: restarting)
        self._redis_down = False
        self._lock = threading.Lock()

    def taken(self, task_id: str, sent: float) -> None:
        """The lease of ``task_id`` was taken, and confirmed, by a call sent at ``sent``."""
        with self._lock:
            self._confirmed[task_id] = sent
            self._taken_over.discard(task_id)

    def confirmed(self, task_id: str, sent: float) -> None:
        """A renewal of ``task_id``'s lease sent at ``sent`` was confirmed (by the replicas too)."""
        with self._lock:
            self._confirmed[task_id] = max(sent, self._confirmed.get(task_id, sent))

    def taken_over(self, task_id: str) -> None:
        """A newer attempt holds job ``task_id``: it must stop."""
        with self._lock:
            self._taken_over.add(task_id)

    def forget(self, task_id: str) -> None:
        """This process no longer holds ``task_id``'s lease."""
        with self._lock:
            self._confirmed.pop(task_id, None)
            self._taken_over.discard(task_id)

    def reached(self) -> None:
        """A renewal reached Redis."""
        self._redis_down = False

    def unreachable(self, exc: BaseException) -> None:
        """A renewal failed with ``exc``: Redis refusing connections (restarting) stops no job."""
        self._redis_down = _refused(exc)

    def must_stop(self, task_id: str) -> str | None:
        """Why job ``task_id`` must be stopped now (self-fencing), or ``None``: its lease has gone
        unconfirmed for :attr:`fence_after_s`, or a newer attempt took it. No round trip."""
        with self._lock:
            if task_id in self._taken_over:
                return "its lease was taken by a newer attempt"
            confirmed = self._confirmed.get(task_id)
        if confirmed is None or self._redis_down:
            # Redis refuses connections: it is not running (restarting), so it gives the lease to
            # no one meanwhile; the keeper restores it once Redis is back (a Redis restart must
            # not stop every running job). A partition that rejects rather than drops packets
            # is taken for that.
            return None
        unconfirmed = time.monotonic() - confirmed
        if unconfirmed < self.fence_after_s:
            return None
        return (f"Redis has not confirmed its lease for {unconfirmed:.1f} s (cut off?); it is stopped before "
                f"the lease's {self._ttl_ms / 1000:g} s can run out and the job be given to another worker")

    def deadline(self, task_id: str) -> float | None:
        """When (this process's monotonic clock) :meth:`must_stop` will say to stop job
        ``task_id`` unless a renewal is confirmed before: the last confirmed renewal's (or the
        take's) send time plus :attr:`fence_after_s`; ``None`` if no lease of it is held."""
        with self._lock:
            confirmed = self._confirmed.get(task_id)
        return None if confirmed is None else confirmed + self.fence_after_s

    def stopped(self, task_id: str, keep_s: int) -> None:
        """Job ``task_id`` was stopped by :meth:`must_stop`: its stop is to be reported (the
        death a reaper may count meanwhile taken back, its note kept ``keep_s`` seconds)."""
        with self._lock:
            self._confirmed.pop(task_id, None)
            self._taken_over.discard(task_id)
            self._reports[task_id] = keep_s

    def has_reports(self) -> bool:
        """Whether a stop is still to be reported to Redis."""
        return bool(self._reports)

    def report(self, jobs: JobState, device: str, note: str) -> None:
        """Report the stops not yet reported (:meth:`JobState.fenced`), as ``note`` on ``device``;
        the rest on a later call if Redis cannot be reached."""
        with self._lock:
            reports = dict(self._reports)
        for task_id, keep_s in reports.items():
            try:
                taken_back = jobs.fenced(task_id, device, note, keep_s)
            except redis.RedisError as exc:  # still cut off: on the next beat
                logger.warning("could not report job %s as fenced yet: %s", task_id, exc)
                return
            with self._lock:
                self._reports.pop(task_id, None)
            logger.warning("reported job %s as stopped by self-fencing%s", task_id,
                           " (the death a reaper counted meanwhile taken back)" if taken_back else "")


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` came of Redis's host refusing the connection (no redis-server there)."""
    cause: BaseException | None = exc
    for _ in range(8):  # a chain of causes, never a cycle's worth
        if cause is None:
            return False
        if isinstance(cause, ConnectionRefusedError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False
