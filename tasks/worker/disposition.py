"""Where a job's message goes: a :data:`Disposition`, decided as a value, applied in one place.

A job's life on its worker is three stages with a typed value between each
(:func:`tasks.worker.runner.execute`): its admission (:mod:`tasks.worker.admission`) gives
:class:`~tasks.worker.admission.Admitted` or a disposition; its run mode (:mod:`tasks.worker.modes`) gives the run's
:class:`~tasks.worker.supervisor.Ended`, which :func:`settle` maps to a disposition; and
:func:`apply` carries it out. :func:`apply` is the one place of the worker that raises Celery's
control-flow exceptions (``Retry``, ``Ignore``, ``Reject``):

- :class:`Store`: the job's end is stored (its entry returned, or its failure raised with its
  entry), its lease released and its message acknowledged with it (:mod:`tasks.core.jobstate`);
- :class:`Drop`: nothing more is stored and the message is acknowledged (a copy that runs
  elsewhere or has finished; a run its worker fenced itself off, whose lease is left to expire);
- :class:`Requeue`: the same message (id, kwargs, chord) back on its queue (``task.retry``),
  never a failure: preempted, given way, unpacked, held back by its cap, handed back by a
  device out of service or one whose constraints it does not meet, a black hole's first fast
  failure;
- :class:`Redeliver`: the message is rejected back to its queue by kombu (a lease no replica
  confirmed: the new primary still has the message).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, assert_never

import redis
from celery.exceptions import Ignore, Reject

from ..core.defaults import CAP_RETRY_S, GIVE_WAY_S
from ..core.errors import DeviceFailed
from ..core.jobcount import count_preemption
from ..core.keys import FRONT_HEADER, OPTIONS_HEADER, PREEMPTIONS_HEADER
from ..core.records import JobOptions
from ..core.wire import Outcome
from .lease import deaths_kept_s
from .supervisor import Ended

if TYPE_CHECKING:
    from .jobrun import JobRun

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Store:
    """Store the job's end: how its run ``ended``, or ``failed`` (refused before it ran, or its
    error named by its worker)."""

    ended: Ended | None = None
    failed: BaseException | None = None


@dataclass(frozen=True)
class Drop:
    """Store nothing; acknowledge the message. ``fenced``: the run's worker fenced itself off it
    (its lease is left to expire, the reaper gives the job back, no death counted)."""

    fenced: bool = False


@dataclass(frozen=True)
class Requeue:
    """The same message back on its queue, ``delay_s`` later, with ``headers`` set over its own;
    ``front``: at the front of its level's list (:data:`~tasks.core.keys.FRONT_HEADER`).
    ``release_lease``: its lease is released first (no attempt spent, no death counted);
    ``preempted``: the device counts a preemption; ``max_retries``: how many times it may come
    back so (None: without bound); ``why``: for the log."""

    delay_s: float = 0.0
    front: bool = False
    headers: Mapping[str, Any] = field(default_factory=dict)
    release_lease: bool = False
    preempted: bool = False
    max_retries: int | None = None
    why: str = ""


@dataclass(frozen=True)
class Redeliver:
    """Reject the message back to its queue (kombu's ``restore_by_tag``), ``why``."""

    why: str


Disposition = Store | Drop | Requeue | Redeliver


@dataclass(frozen=True)
class JobFacts:
    """What :func:`settle` needs of a job besides its ending."""

    options: JobOptions
    #: Sent to this device by name (its own queue): it could have run nowhere else.
    by_name: bool = False
    #: It ran over its user's cap (:mod:`tasks.core.caps`).
    borrowed: bool = False
    #: How many times it was preempted before (its message's header).
    preemptions: int = 0
    #: Whether a failure of it goes back to its queue (the black-hole rule,
    #: :mod:`tasks.worker.blackhole`); asked only of an :data:`~tasks.core.wire.Outcome.ERROR`.
    sent_back: Callable[[Ended], bool] = lambda ended: False


def settle(ended: Ended, job: JobFacts) -> Disposition:
    """Where a run that ``ended`` so goes, by its outcome: its end stored; nothing stored
    (fenced); or its message back on its queue (preempted: at once, at the front; given way:
    later; unpacked: at once, to run alone; its device failed under it; a black hole's first
    fast failure). mypy's ``assert_never`` holds every outcome to one disposition."""
    match ended.outcome:
        case Outcome.FENCED:
            # Cut off from Redis, it stopped the job itself: no result of this attempt may be stored.
            return Drop(fenced=True)
        case Outcome.PREEMPTED:
            return preempted(ended, job)
        case Outcome.UNPACK:
            # Its pack could not finish it (the pack's process died): back to its queue at once,
            # to run alone, so a trial that kills its process kills only itself the next time.
            alone = job.options.model_copy(update={"pack": None}).to_dict()
            return Requeue(headers={OPTIONS_HEADER: alone}, release_lease=True)
        case Outcome.GIVE_WAY:
            return Requeue(delay_s=GIVE_WAY_S)  # it gave its device to an older gang or group
        case Outcome.DEVICE_FAILED if job.by_name:
            # Sent to this device and no other: its entry says the device failed, at once (its
            # process may have crashed first on the failing GPU: the device's failure is why).
            return Store(ended=ended, failed=DeviceFailed(ended.stop.message) if ended.stop is not None else None)
        case Outcome.DEVICE_FAILED:
            # Its device failed under it (and is drained): back to its shared queue at once.
            why = ended.error.message if ended.error is not None else "its device failed"
            return Requeue(release_lease=True, why=why)
        case Outcome.ERROR if job.sent_back(ended):
            return Requeue(release_lease=True, why="its first fast failure on this device")
        case Outcome.OK | Outcome.ERROR | Outcome.CANCELLED | Outcome.PEER_LOST:
            return Store(ended=ended)
        case _:
            assert_never(ended.outcome)


def preempted(ended: Ended, job: JobFacts) -> Requeue:
    """A preempted job's message back on its queue (:mod:`tasks.worker.preemption`): the same
    id, kwargs, options and chord, its count of preemptions one more, at the front of its level's
    list, so it keeps its place among its level: it runs before the work of its level sent after
    it. Its lease is released first, so the worker that takes it next takes it at once. A job that
    ran ``borrowed`` (over its user's cap, :mod:`tasks.core.caps`) made way for work of its own
    level, which its user's list could come before (users go least usage first): it comes back
    :data:`~tasks.core.defaults.CAP_RETRY_S` later, at the back, so the freed slot takes that work."""
    count = job.preemptions + 1
    level = ended.stop.level if ended.stop is not None else None
    why = f"made way for {level.value if level is not None else 'higher-level'} work (preemption {count})"
    return Requeue(delay_s=CAP_RETRY_S if job.borrowed else 0.0, front=not job.borrowed,
                   headers={PREEMPTIONS_HEADER: count}, release_lease=True, preempted=True, why=why)


def apply(disposition: Disposition, run: JobRun, ran: bool = True) -> dict[str, Any]:
    """Carry ``disposition`` out for ``run`` (``ran``: after its run, which ends its busy state)
    and return its entry.

    Raises:
        Exception: its end is a failure, stored by Celery with its error entry.
        celery.exceptions.Ignore: it was dropped, or cancelled (REVOKED is stored already).
        celery.exceptions.Retry: it goes back to its queue.
        celery.exceptions.Reject: it is redelivered.
    """
    task, leases = run.task, run.worker.leases
    if ran and not isinstance(disposition, Store):
        run.idle(done=False)
    match disposition:
        case Store(ended=ended, failed=failed):
            entry = run.end(ended=ended, failed=failed)
            if entry is not None:
                return entry
            leases.settle(run.job_id, task.request)  # the store of its cancelled state released it
            raise Ignore()
        case Drop(fenced=fenced):
            if fenced:
                leases.fenced(run.job_id, deaths_kept_s(task.app))
            raise Ignore()
        case Requeue() as back:
            if back.why:
                logger.info("job %s on %s: %s; back to its queue", run.job_id, run.worker.device, back.why)
            if back.release_lease:
                leases.release(run.job_id)
            if back.preempted:
                try:
                    count_preemption(run.worker.client, run.worker.device.name)
                except redis.RedisError as exc:  # a figure only: the job goes back all the same
                    logger.warning("could not count the preemption of job %s: %s", run.job_id, exc)
            headers = {**back.headers, **({FRONT_HEADER: True} if back.front else {})}
            options = {"headers": {**dict(task.request.headers or {}), **headers}} if headers else {}
            raise task.retry(countdown=back.delay_s, max_retries=back.max_retries, **options)
        case Redeliver(why=why):
            raise Reject(why, requeue=True)
        case _:
            assert_never(disposition)
