"""Leases: a running job is owned by one live worker, and a dead worker's job runs again fast.

The threads of a worker's side of a job's protocol in Redis, and what they do with each reply;
the scripts themselves, the one interface that calls them (:class:`tasks.core.jobstate.JobState`)
and the whole sequence (take, renew, finish, release, reap, deaths) are in
:mod:`tasks.core.jobstate`.

Celery's Redis transport returns an unacknowledged message only after ``visibility_timeout``
(an hour), and a shorter timeout runs long jobs twice (celery#4984, #3501). devicefleet keeps the
long timeout and adds a lease per running job, taken as the job starts and released with the
store of its result (:mod:`tasks.core.jobstate`): a second copy of the same message (a
visibility-timeout restore while the first still runs) finds it held by a live owner and is
dropped (:class:`tasks.worker.disposition.Drop`), so a job never runs twice at the same time;

- a :class:`LeaseKeeper` thread renews the leases of the jobs this process runs;
- a :class:`~tasks.worker.reaper.Reaper` thread gives back to their queues the jobs whose lease
  expired with their owner dead (or orphaned: :mod:`tasks.worker.reaper`).

A worker cut off from Redis (a network partition) is not dead, and its job must not run on
beside the copy the reaper gives to another worker: the keeper's :class:`~tasks.worker.fence.Fence`
stops it (self-fencing, :mod:`tasks.worker.fence`).

A job that takes its whole worker down (it kills it, or the machine's OOM killer does) would
then run again for ever, its worker restarted each time. So each such death is counted where it
is seen: by the reaper when it gives back a dead owner's lease, or by the take script when a
worker takes over a dead owner's lease; either pushes the dead worker's name onto
``keys.worker_deaths(task_id)`` in the same script call that removes the dead lease (so one death
is counted once, whoever sees it first). A job refused by a live owner, or sent again by a
distributed rank that gave way, is no death. The take script refuses to run a job that has
``max_attempts`` deaths (:attr:`tasks.core.records.JobOptions.max_attempts`): it takes the lease
and says :attr:`Take.LOST`, and :meth:`LeaseKeeper.hold` records a
:class:`~tasks.core.records.DeadLetter` (``keys.DEAD_LETTERS``) and returns a
:class:`~tasks.core.errors.WorkerLost`, which the runner stores as the job's failure (its
lease released and its message acknowledged with it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import redis
from celery import Celery
from celery.states import STARTED
from kombu.utils.encoding import bytes_to_str
from pydantic import ValidationError

from ..core import keys
from ..core.devices import host_name
from ..core.errors import WorkerLost
from ..core.job import TASK_PREFIX
from ..core.jobstate import Attempt, JobState, StateMeta, Stored, TakeReply, Took, handover
from ..core.periodic import PeriodicThread
from ..core.records import DeadLetter, JobOptions, LeaseRecord, ResendRecord, WorkerRecord, stored
from ..core.registry import read_worker
from ..core.sentinel import Replication
from ..core.settings import Settings
from .fence import Fence
from .replicated import ReplicatedWrites

logger = logging.getLogger(__name__)

#: How long a job's count of worker deaths is kept by :meth:`LeaseKeeper.take` when the caller
#: does not say (the default expiry of results; :func:`deaths_kept_s` reads an app's).
DEATHS_KEPT_S: int = Settings.model_fields["result_expires_s"].default

class Take(str, Enum):
    """What :meth:`LeaseKeeper.take` found (where the message goes then:
    :func:`tasks.worker.admission.of_lease`)."""

    #: The lease is ours: run the job.
    TAKEN = "taken"
    #: Another live worker runs the job now: drop this copy.
    RUNNING_ELSEWHERE = "running elsewhere"
    #: The job's result is stored: drop this copy.
    FINISHED = "finished"
    #: The lease is ours, but the job has taken its worker down ``max_attempts`` times: end it
    #: as :class:`~tasks.core.errors.WorkerLost` instead of running it.
    LOST = "lost"
    #: The primary took the lease but no replica had it in time (a primary cut off from its
    #: replicas: :class:`~tasks.core.sentinel.Replication`): it is no lease, and was released.
    UNCONFIRMED = "unconfirmed"
    #: This device is out of service (:mod:`tasks.core.device_state`): nothing taken.
    OUT_OF_SERVICE = "out of service"
    #: Its user (or team) holds its cap of this device's kind (:mod:`tasks.core.caps`): not taken.
    CAPPED = "capped"


@dataclass(frozen=True)
class Taken:
    """What :meth:`LeaseKeeper.take` did: with :attr:`Take.TAKEN` and :attr:`Take.LOST` the
    :class:`~tasks.core.jobstate.Attempt` now held, with :attr:`Take.LOST` the workers the job
    took down (``"<worker> pid <pid>"``, oldest first)."""

    outcome: Take
    lost_to: tuple[str, ...] = ()
    attempt: Attempt | None = None
    #: With :attr:`Take.OUT_OF_SERVICE`: the device's state.
    out: str = ""
    #: With :attr:`Take.CAPPED`: why (``alice: 1/1 cpu (cap), borrowing off``).
    capped: str | None = None
    #: With :attr:`Take.LOST` from :meth:`LeaseKeeper.hold`: the job's failure, to store.
    error: WorkerLost | None = None


def parse_lease(raw: str | bytes | None) -> LeaseRecord | None:
    """The lease record stored as ``raw`` (``None``: none, or not one)."""
    if not raw:
        return None
    try:
        return stored(LeaseRecord, raw)
    except ValidationError:
        return None


def live_owner(client: redis.Redis, lease: LeaseRecord) -> WorkerRecord | None:
    """The registry record of the lease's owner if it is still the live worker of its device."""
    record = read_worker(client, lease.device)
    return record if record is not None and record.same_process(lease.host, lease.pid) else None


def owner_alive(client: redis.Redis, lease: LeaseRecord) -> bool:
    """Whether the lease's owner is still the live worker of its device."""
    return live_owner(client, lease) is not None


def death_note(lease: LeaseRecord) -> str:
    """How a dead owner is named in a job's deaths and its :class:`~tasks.core.errors.WorkerLost`."""
    return f"{lease.worker} pid {lease.pid}"


def deaths_kept_s(app: Celery) -> int:
    """How long a job's count of worker deaths is kept: as long as its result (0: for ever)."""
    expires = app.conf.result_expires
    if isinstance(expires, timedelta):
        return int(expires.total_seconds())
    return int(expires or 0)


class LeaseKeeper(PeriodicThread):
    """Takes, renews and releases the leases of the jobs this worker process runs.

    A job's lease goes with its stored result: :meth:`finishing` hands its attempt to the job's
    end (:class:`tasks.core.jobstate.JobEnd`), whose store script releases it in the same call;
    :meth:`settle`, after the store, forgets it (or releases it, had the store not run). Until
    then it is renewed (never restored once finishing: the store may have deleted it).

    Self-fencing (:mod:`tasks.worker.fence`): the keeper tells its :attr:`fence` which renewals
    Redis confirmed (on a fleet with replicas, :class:`~tasks.worker.replicated.ReplicatedWrites`
    asks a replica too) and which leases a newer attempt took; a job the fence says must stop
    (:meth:`must_stop`) is never renewed, and once stopped (:meth:`fenced`) is the fence's.
    """

    name = "devicefleet-leases"

    def __init__(self, client: redis.Redis, device: str, worker: str, ttl_s: float,
                 replication: Replication | None = None) -> None:
        super().__init__(ttl_s / 3)
        self._client = client
        #: Its writes and their confirmation by replicas: a taken lease waits for the replicas
        #: (a failover must not lose it: see the module), a renewal counts once they have it.
        self._writes = ReplicatedWrites(client, replication)
        self.device = device
        self.worker = worker
        self._ttl_ms = int(ttl_s * 1000)
        #: What Redis last confirmed of each lease held here, and which jobs must stop (self-fencing).
        self.fence = Fence(ttl_s)
        self._held: dict[str, Attempt] = {}  # task id -> the attempt this process runs
        self._finishing: set[str] = set()  # task ids whose lease the result backend releases
        self._lock = threading.Lock()

    @property
    def _jobs(self) -> JobState:
        return self._writes.jobs

    def stop(self, timeout: float | None = None) -> None:
        """Stop renewing; the keeper's own connection (with replicas) goes back to its pool."""
        super().stop(timeout)
        self._writes.close()

    def held(self) -> list[str]:
        """The task ids whose leases this process holds now. For tests: the worker keeps no list."""
        with self._lock:
            return list(self._held)

    def take(self, task_id: str, delivery_tag: str | None, resend: ResendRecord | None = None,
             started: StateMeta | None = None, max_attempts: int | None = None,
             keep_s: int = DEATHS_KEPT_S, user: str | None = None) -> Taken:
        """Take the lease of ``task_id`` and, with ``started``, store the job's STARTED state:
        one script call, which first checks that the job's result is not stored yet.

        A lease left by a dead owner (its key not yet expired, or expired and not yet reaped) is
        taken over (a second call, only then), and the owner's death is counted with it (kept
        ``keep_s`` seconds). A job whose runs took their worker down ``max_attempts`` times
        (``None``: no bound) is not to be run: its lease is taken all the same (a copy arriving
        meanwhile is dropped; the store of its failure releases it) and the outcome is
        :attr:`Take.LOST`. ``resend`` is what the reaper needs to send the job again when its
        message is no longer in Redis. ``user``: whom the job runs for, whose cap the take
        script checks (:mod:`tasks.core.caps`: :attr:`Take.CAPPED` when it is held).
        """
        sent = time.monotonic()
        record = LeaseRecord(device=self.device, worker=self.worker, pid=os.getpid(), host=host_name(),
                             task_id=task_id, delivery_tag=delivery_tag, since=time.time(), resend=resend,
                             user=user)

        def call(expect: str, dead: str) -> TakeReply:
            return self._jobs.take(record, self._ttl_ms, started=started, replace=expect, dead=dead,
                                   max_attempts=max_attempts or 0, keep_s=keep_s, device=self.device)

        reply = call("", "")
        if reply.status is Took.OUT:
            return Taken(Take.OUT_OF_SERVICE, out=reply.out)
        if reply.status in (Took.HELD, Took.EXPIRED):
            raw = reply.holder or ""
            holder = parse_lease(raw)
            dead = ""
            if holder is not None and holder.pid == os.getpid() and holder.host == host_name():
                with self._lock:
                    running_here = task_id in self._held
                if running_here:  # a copy reached another thread of this process: not twice at once
                    logger.warning("job %s already runs in this worker; not running this copy", task_id)
                    return Taken(Take.RUNNING_ELSEWHERE)
                # else a lease this process left behind (its release failed): take it again
            elif holder is not None and owner_alive(self._client, holder):
                # Its key expired ('expired'): the owner is late to renew (Redis was away), and
                # the reaper leaves it alone for that reason too.
                logger.warning("job %s already runs on %s (pid %s); not running this copy",
                               task_id, holder.worker, holder.pid)
                return Taken(Take.RUNNING_ELSEWHERE)
            else:
                logger.warning("taking over the lease of job %s from dead %s", task_id,
                               holder.worker if holder else "owner")
                dead = death_note(holder) if holder is not None else ""
            # Only if it still holds what we read: two workers cannot both take it over, nor
            # count its owner's death twice (nor once more after the reaper did).
            reply = call(raw, dead)
        attempt = reply.attempt
        if reply.status is Took.CAPPED:
            logger.info("job %s waits for its cap (%s): back to its queue", task_id, reply.capped)
            return Taken(Take.CAPPED, capped=reply.capped)
        if reply.status is Took.FINISHED:
            logger.warning("job %s has already finished; not running this copy", task_id)
            return Taken(Take.FINISHED)
        if attempt is None:
            logger.warning("job %s was taken by another worker meanwhile; not running this copy", task_id)
            return Taken(Take.RUNNING_ELSEWHERE)
        if not self._writes.wait(f"lease of job {task_id}"):
            # No replica has it: a failover may drop it, and a promoted replica's copy of the
            # job is free for another worker. Not a lease (Replication's rule): give it up.
            logger.warning("job %s: no replica confirmed its lease; not running this copy, it goes back to its queue",
                           task_id)
            self._give_up(attempt)
            return Taken(Take.UNCONFIRMED)
        with self._lock:
            self._held[task_id] = attempt
            self.fence.taken(task_id, sent)
            self._finishing.discard(task_id)
        if reply.status is Took.LOST:
            return Taken(Take.LOST, reply.lost_to, attempt)
        return Taken(Take.TAKEN, attempt=attempt)

    def _drop(self, task_id: str) -> Attempt | None:
        """Stop keeping ``task_id``'s lease (caller holds the lock); returns its attempt."""
        self._finishing.discard(task_id)
        self.fence.forget(task_id)
        return self._held.pop(task_id, None)

    def release(self, task_id: str) -> None:
        """Give up ``task_id``'s lease, if this process holds it, without a result."""
        with self._lock:
            attempt = self._drop(task_id)
        if attempt is not None:
            self._give_up(attempt)

    def _give_up(self, attempt: Attempt) -> None:
        """Release ``attempt``'s lease in Redis (only while it is still that attempt's)."""
        task_id = attempt.task_id
        try:
            # Only our own lease: a worker that was cut off must not delete its successor's.
            if not self._jobs.release(attempt):
                logger.warning("job %s: its release was refused, a newer attempt holds it (token %d is older)",
                               task_id, attempt.token)
        except redis.RedisError as exc:  # the reaper finds an owner that is alive: no harm
            logger.warning("could not release the lease of job %s: %s", task_id, exc)

    def borrowed(self, task_id: str) -> bool:
        """Whether this process holds ``task_id``'s lease as borrowed work (over its user's cap)."""
        with self._lock:
            attempt = self._held.get(task_id)
        return attempt is not None and attempt.borrowed

    def finishing(self, task_id: str) -> Attempt | None:
        """Hand ``task_id``'s attempt to the store of its result, whose script releases its lease
        (``None`` if this process holds none). Renewal goes on until :meth:`settle`, but never
        brings the lease back once the store has deleted it."""
        with self._lock:
            attempt = self._held.get(task_id)
            if attempt is not None:
                self._finishing.add(task_id)
        return attempt

    def forget(self, task_id: str) -> None:
        """The store script released ``task_id``'s lease: stop renewing it (no round trip)."""
        with self._lock:
            self._drop(task_id)

    @property
    def fence_after_s(self) -> float:
        """How long a lease may go unconfirmed before its job is stopped (:class:`Fence`)."""
        return self.fence.fence_after_s

    @property
    def fence_grace_s(self) -> float:
        """The grace of a job's stop when its worker fences itself off it (:class:`Fence`)."""
        return self.fence.fence_grace_s

    def must_stop(self, task_id: str) -> str | None:
        """Why job ``task_id`` must be stopped now (self-fencing), or ``None``
        (:meth:`Fence.must_stop`). No round trip."""
        return self.fence.must_stop(task_id)

    def superseded(self, task_id: str) -> None:
        """A write of job ``task_id``'s attempt was refused (a newer attempt holds the job): it is
        to be stopped (:meth:`must_stop`), as when a renewal finds the lease taken."""
        with self._lock:
            if task_id in self._held:
                self.fence.taken_over(task_id)
        logger.error("job %s: a write of its attempt was refused, a newer attempt holds it: stopping it", task_id)

    def fenced(self, task_id: str, keep_s: int = DEATHS_KEPT_S) -> None:
        """Job ``task_id`` was stopped by :meth:`must_stop`: leave its lease to expire (the
        reaper gives the job back) and report the stop to Redis, now or once it is reachable
        (the next ticks), so that no death is counted for it."""
        with self._lock:
            self._drop(task_id)
            self.fence.stopped(task_id, keep_s)
        logger.error("job %s stopped: its worker fenced itself off it (its lease left to expire, the job given back)",
                     task_id)
        self.wake()

    def settle(self, task_id: str, request: Any) -> None:
        """After the store of job ``task_id``'s outcome (``task_postrun``, which Celery sends
        once the outcome is stored and before the message is acknowledged; or a run that stored
        nothing more: :func:`tasks.worker.disposition.apply`): if the store ran with the job's end
        for the attempt held here (:func:`tasks.core.jobstate.handover` on the task's ``request``), its script released
        the lease: forget it, no round trip. Else release what is still held (the store failed,
        or stored no end: a retry)."""
        with self._lock:
            attempt = self._held.get(task_id)
        if attempt is None:
            return
        handed = handover(request)
        if handed is not None and handed.stored is Stored.FENCED:
            logger.error("job %s: the store of its end was refused: a newer attempt holds the job (token %d is "
                         "older); this run's result is dropped", task_id, attempt.token)
        elif handed is not None and handed.stored is not None and not handed.confirmed:
            logger.error("job %s: no replica confirmed the store of its end: not done (a failover now would drop "
                         "it); its message stays unacknowledged elsewhere, and the job runs again if it is lost",
                         task_id)
        if handed is not None and handed.stored is not None and handed.end.attempt == attempt:
            self.forget(task_id)
        else:
            self.release(task_id)

    def hold(self, task: Any, max_attempts: int | None = None, user: str | None = None) -> Taken:
        """Take ``task``'s lease and store its STARTED state (one round trip: Celery's STARTED meta,
        :func:`started_meta`; the job task has ``track_started`` off); returns what was taken, never
        raises for the take's sake (the admission makes a refusal a disposition:
        :func:`tasks.worker.admission.of_lease`).

        A lease taken is held until the job's result is stored: the job's end takes the attempt
        (:meth:`finishing`) to the result backend, whose script call that stores the result
        releases it; ``task_postrun``, after the store and before the acknowledgement, settles it
        (:meth:`settle`). So a copy redelivered at any moment finds the lease held or the result
        stored. ``max_attempts`` bounds the runs that take their worker down (default: the
        :class:`~tasks.core.records.JobOptions` default); ``user`` is whom it runs for (its cap).
        A job lost (:attr:`Take.LOST`) is kept as a dead letter (:func:`dead_letter`), its lease
        held to go with its stored failure, :attr:`Taken.error`.
        """
        task_id, resend = str(task.request.id), resend_of(task)
        bound = max_attempts if max_attempts is not None else JobOptions().max_attempts
        taken = self.take(task_id, (task.request.properties or {}).get("delivery_tag"), resend, started_meta(task),
                          max_attempts=bound, keep_s=deaths_kept_s(task.app), user=user)
        if taken.outcome is Take.LOST:
            lost = dead_letter(self._client, self.device, task_id, resend, taken.lost_to, bound)
            return dataclasses.replace(taken, error=lost)
        return taken

    @contextmanager
    def running(self, task_id: str) -> Iterator[None]:
        """A job's run under its lease: a BaseException not an Exception (the worker is going
        down) releases it at once; anything else leaves it to the store of the job's end."""
        try:
            yield
        except Exception:
            raise  # Celery stores the failure (and the lease with it), then task_postrun settles it
        except BaseException:
            self.release(task_id)
            raise

    def tick(self) -> None:
        if self.fence.has_reports():
            self.fence.report(self._jobs, self.device, f"{self.worker} pid {os.getpid()}")
        with self._lock:
            held = dict(self._held)
            finishing = set(self._finishing)
        renewed: dict[str, float] = {}  # task id -> when its renewal was sent
        for task_id, attempt in held.items():
            if self.must_stop(task_id) is not None:
                continue  # being stopped: its lease must expire, never come back
            sent = time.monotonic()
            try:
                ours = self._jobs.renew(attempt, self._ttl_ms, restore=task_id not in finishing)
            except redis.RedisError as exc:  # Redis restarting or cut off: renew on the next beat
                self.fence.unreachable(exc)
                logger.warning("could not renew the lease of job %s: %s", task_id, exc)
                continue
            self.fence.reached()
            if ours:
                renewed[task_id] = sent
                continue
            with self._lock:
                if task_id in self._held:
                    self.fence.taken_over(task_id)
            logger.error("the lease of job %s was taken over by a newer attempt: stopping it", task_id)
        # A renewal no replica has does not count (Replication's rule): a promoted replica's copy
        # of a lease expires from the last renewal it had, so a job must stop from that one. One
        # WAIT for the round's renewals (replicated in order); none with replicas=0.
        if not renewed or not self._writes.confirmed(f"renewal of the leases of jobs {', '.join(renewed)}"):
            return
        with self._lock:
            for task_id, sent in renewed.items():
                if task_id in self._held:
                    self.fence.confirmed(task_id, sent)


def resend_of(task: Any) -> ResendRecord:
    """What the reaper needs to send ``task``'s job again, from its request."""
    request = task.request
    return ResendRecord(
        name=task.name, kwargs=request.kwargs or {}, queue=(request.delivery_info or {}).get("routing_key"),
        headers=dict(request.headers or {}), chord=request.chord, group_id=request.group,
        group_index=request.group_index, root_id=request.root_id, parent_id=request.parent_id,
    )


def dead_letter(client: redis.Redis, device: str, task_id: str, resend: ResendRecord, workers: tuple[str, ...],
                max_attempts: int) -> WorkerLost:
    """Record a job given up on ``device`` as a dead letter (``keys.DEAD_LETTERS``); returns its error."""
    letter = DeadLetter(task_id=task_id, job=resend.name.removeprefix(TASK_PREFIX), device=device,
                        queue=resend.queue, kwargs=resend.kwargs, workers=list(workers),
                        max_attempts=max_attempts, at=time.time(), group_id=resend.group_id)
    try:
        client.hset(keys.DEAD_LETTERS, task_id, letter.to_json())
    except redis.RedisError as exc:  # the job still ends: its stored failure says why
        logger.error("could not record job %s as a dead letter: %s", task_id, exc)
    logger.error("job %s (%s) took its worker down %d times (%s); not running it again",
                 task_id, letter.job, len(workers), ", ".join(workers))
    return WorkerLost(
        f"job {task_id} ({letter.job}) took its worker down {len(workers)} times ({', '.join(workers)}); "
        f"not running it again (max_attempts={max_attempts}). It is kept as a dead letter "
        "(`devicefleet status`, tasks.dead_letters()); fix the job, then send it again as a new one."
    )


def started_meta(task: Any) -> StateMeta | None:
    """The STARTED state Celery's ``track_started`` would store for ``task``'s request, made by
    its result backend (``None`` if the backend is not a key-value store)."""
    backend = task.backend
    if not hasattr(backend, "get_key_for_task"):
        return None
    request = task.request
    # The token first: the take script stamps it there (jobscripts.UNSTAMPED_META).
    meta = backend._get_result_meta(result={"token": None, "pid": os.getpid(), "hostname": request.hostname},
                                    state=STARTED, traceback=None, request=request)
    meta["task_id"] = str(request.id)
    key = backend.get_key_for_task(str(request.id))
    return StateMeta(key=bytes_to_str(key), value=str(backend.encode(meta)), expires_s=int(backend.expires or 0))
