"""Preemption: work of a higher level that waits for a busy device takes it.

A worker takes the highest level waiting whenever a slot frees (:mod:`tasks.core.priority`); a
long ``batch`` job would still hold its device for hours while ``urgent`` work waits. So while
this worker runs a job below the top level, :class:`Preemption` looks every
:data:`~tasks.core.defaults.PREEMPT_CHECK_S` at the lists of the higher levels of every queue the
worker consumes now: its own, its kind's, ``fleet``, the config's ``extra_queues`` and the sweeps'
own queues it was asked to consume (kombu's selected queues; one pipelined round trip of
``LLEN``; none while it runs nothing, or only top-level or non-preemptible jobs). When one holds a
message and every slot is busy, the job's watch (:class:`tasks.worker.watch.JobWatch`) asks the
job to make way, once it has run ``preempt_min_run_s`` and unless its options say
``preemptible=False``:

- one job per waiting message, across the fleet: before a job is asked, its worker claims one
  of the messages waiting in that list (:func:`tasks.core.keys.preempt_claims`, a script that
  adds a claim only while the list holds more messages than claims). Work sent to a kind
  (``cpu:urgent``) that every busy worker of the kind sees preempts one job, not one per device;
  a claim lasts until the job it preempted has ended and
  :data:`~tasks.core.defaults.PREEMPT_CLAIM_HOLD_S` more (its freed slot takes the message then),
  ``preempt_grace_s`` plus that at most (a worker that dies holding it);
- the job is told: ``ctx.preempted()`` turns true and its next ``ctx.progress()`` raises
  :class:`~tasks.core.errors.Preempted`; a command gets SIGTERM;
- it has ``preempt_grace_s`` to checkpoint and stop, then its process group is ended, as a
  cancelled job's is (:mod:`tasks.worker.supervisor`);
- its message goes back to its queue, as a distributed rank that gives way does: the same id,
  kwargs, options and chord, with ``devicefleet_preemptions`` one more
  (:data:`~tasks.core.keys.PREEMPTIONS_HEADER`), at the front of its level's list
  (:data:`~tasks.core.keys.FRONT_HEADER`): it keeps its place, before the work of its level sent
  after it. Its lease is released first, so whichever worker takes it next takes it at once. No
  death is counted and ``max_attempts`` is untouched; its entry says only ``preemptions``. It
  runs again (``ctx.attempt``, ``DEVICEFLEET_ATTEMPT`` one more) with the same
  ``artifacts_dir``: ``train`` resumes from its checkpoint there.

The free slot then takes the highest level waiting: the work that preempted the job.

A rank of a distributed job is preempted with its gang, as a whole (:mod:`tasks.worker.gang`:
its worker marks the gang, and every rank stops). Not preempted: a job of a device group (its
devices would have to stop as a whole), a job run in process (no message to send back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from ..core import keys
from ..core.caps import blocking, read_cap_uses
from ..core.defaults import PREEMPT_CHECK_S, PREEMPT_CLAIM_HOLD_S, PREEMPT_GRACE_S
from ..core.periodic import PeriodicThread
from ..core.priority import Level
from ..core.queue_lists import (
    count_waiting,
    leveled,
    lists_beside,
    split_level,
    split_user,
    user_lists,
    waiting_users,
)

logger = logging.getLogger(__name__)

#: Claim one of the messages waiting in the first list that has one to spare. KEYS: pairs of
#: (queue list, its claims); ARGV: the claiming job's id, the claim's lifetime in seconds, then
#: per list this worker's claim whose job has ended (held for its freed slot; "" if none), which
#: the new claim replaces whatever the count. Returns the 1-based index of the list claimed, or 0.
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[2])
for i = 1, #KEYS / 2 do
  local list, claims = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('ZREMRANGEBYSCORE', claims, '-inf', now)
  local held = ARGV[2 + i]
  local reuse = held ~= '' and redis.call('ZSCORE', claims, held)
  if reuse or redis.call('ZCARD', claims) < redis.call('LLEN', list) then
    if reuse then redis.call('ZREM', claims, held) end
    redis.call('ZADD', claims, now + ttl, ARGV[1])
    redis.call('EXPIRE', claims, math.ceil(ttl) + 1)
    return i
  end
end
return 0
"""
#: A claim whose job has ended lasts ARGV[2] seconds more (if it is still there).
_HOLD = """
local t = redis.call('TIME')
return redis.call('ZADD', KEYS[1], 'XX', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2]), ARGV[1])
"""


def consumed_lists(app: Any, queues: list[str]) -> Callable[[], list[str]]:
    """What :class:`Preemption` looks at on a worker of Celery ``app`` whose own queues are
    ``queues``: the lists its consumer takes from now (kombu's selected queues: every level of
    ``queues``, and each sweep's own list it was asked to consume since), read from the
    consumer's state at each look."""
    own = leveled(queues)

    def lists() -> list[str]:
        try:
            selected = list(app.amqp.queues.consume_from)  # a dict the consumer changes: one copy
        except RuntimeError:  # changed while copied: the next look reads it again
            selected = []
        return selected or own

    return lists


class Preemption(PeriodicThread):
    """Looks for higher-level work waiting in this worker's queues while it runs lower-level
    jobs; :meth:`outranked` says whether a job is due to make way, :meth:`claim` claims the
    message it makes way for as it is asked."""

    name = "devicefleet-preemption"

    def __init__(self, client: redis.Redis, lists: Callable[[], Iterable[str]], slots: int, min_run_s: float,
                 grace_s: float = PREEMPT_GRACE_S, interval_s: float = PREEMPT_CHECK_S,
                 hold_s: float = PREEMPT_CLAIM_HOLD_S) -> None:
        super().__init__(interval_s)
        self._client = client
        self._lists = lists
        self._slots = slots
        self.min_run_s = min_run_s
        self._claim_ttl_s = grace_s + hold_s
        self._hold_s = hold_s
        self._claim = client.register_script(_CLAIM)
        self._hold = client.register_script(_HOLD)
        self._lock = threading.Lock()
        #: job id -> level of the preemptible jobs this worker runs now
        self._running: dict[str, Level] = {}
        #: The highest level found waiting at the last look taken after every job in
        #: ``_running`` started (None: none, or not looked yet).
        self._waiting: Level | None = None
        #: The lists above the lowest running job's level that held messages (that look),
        #: highest level first, with their levels.
        self._waiting_lists: list[tuple[Level, str]] = []
        #: How many messages of a higher level than the lowest running job's wait (that look).
        self._waiting_count = 0
        #: The jobs asked to make way, until they end, and the list each claimed a message of.
        self._making_way: dict[str, str] = {}
        #: list -> this worker's claim there whose job has ended (its freed slot takes the
        #: message), which a job of this worker asked next may take over, with when it ended.
        self._held: dict[str, tuple[str, float]] = {}
        #: job id -> the look at which its claim was refused: tried again at the next look.
        self._refused: dict[str, int] = {}
        #: One more per look that found work waiting.
        self._look = 0
        #: One more per job started: a look sent before a job started does not count for it.
        self._generation = 0
        #: job id -> (user, device kind) of the running jobs taken over their user's cap, as
        #: borrowed work (:mod:`tasks.core.caps`): any work of another user under its cap takes
        #: their device back, whatever its level.
        self._borrowed: dict[str, tuple[str, str]] = {}
        #: The lists holding such work (that look), highest level first, with their levels.
        self._lender_lists: list[tuple[Level, str]] = []
        self._lender_count = 0

    def running(self, job_id: str, level: Level, borrowed: tuple[str, str] | None = None) -> None:
        """A preemptible job at ``level`` starts: look at once (an earlier look is stale).
        ``borrowed``: its ``(user, device kind)`` when it runs over its user's cap, as
        borrowed work, which any waiting work of another user under its cap takes back."""
        with self._lock:
            self._running[job_id] = level
            self._waiting = None
            self._lender_lists, self._lender_count = [], 0
            self._generation += 1
            if borrowed is not None:
                self._borrowed[job_id] = borrowed
        if level.rank > 0 or borrowed is not None:
            self.wake()

    def done(self, job_id: str) -> None:
        """A job ended; a claim it held lasts :data:`PREEMPT_CLAIM_HOLD_S` more, for the slot
        it freed to take the message it was made for (or a job of this worker asked next)."""
        with self._lock:
            self._running.pop(job_id, None)
            self._borrowed.pop(job_id, None)
            self._refused.pop(job_id, None)
            claimed = self._making_way.pop(job_id, None)
            if claimed is not None:
                self._held[claimed] = (job_id, time.monotonic())
        if claimed is None:
            return
        try:
            self._hold(keys=[keys.preempt_claims(claimed)], args=[job_id, self._hold_s])
        except redis.RedisError as exc:  # it expires on its own, preempt_grace_s later at most
            logger.warning("could not shorten the preemption claim of job %s: %s", job_id, exc)

    def outranked(self, job_id: str, level: Level, started: float) -> Level | None:
        """The higher level whose work waits for this device, if job ``job_id`` at ``level``,
        started at ``started`` (monotonic), is due to make way for it now; else None. A question
        only (no round trip): :meth:`claim` takes the waiting message before the job is asked.
        None too once the job was asked, and while the waiting messages are each claimed, or
        its claim was refused at this look (it is tried again at the next)."""
        with self._lock:
            return self._outranked(job_id, level, started)

    def _outranked(self, job_id: str, level: Level, started: float) -> Level | None:
        if job_id in self._borrowed and self._lender_lists:
            waiting: Level | None = self._lender_lists[0][0]
            count = self._lender_count
        else:
            waiting, count = self._waiting, self._waiting_count
            if waiting is None or waiting.rank >= level.rank:
                return None
        if time.monotonic() - started < self.min_run_s:
            return None
        if job_id in self._making_way or len(self._making_way) >= count:
            return None
        if self._refused.get(job_id) == self._look:
            return None
        return waiting

    def claim(self, job_id: str, level: Level, started: float) -> Level | None:
        """Claim one of the messages waiting above ``level`` for job ``job_id`` to make way for
        (:meth:`outranked` first) and return its level; None if it is not outranked or the claim
        went to another job. One job is asked per waiting message, across the workers that
        consume its list: the others run on. A claim refused is tried again at the next look."""
        with self._lock:
            if self._outranked(job_id, level, started) is None:
                return None
            if job_id in self._borrowed and self._lender_lists:
                lists = [name for _, name in self._lender_lists]
            else:
                lists = [name for above, name in self._waiting_lists if above.rank < level.rank]
            expired = time.monotonic() - self._hold_s
            held = [self._held[name][0] if name in self._held and self._held[name][1] > expired else ""
                    for name in lists]
            look = self._look
        args: list[Any] = [job_id, self._claim_ttl_s, *held]
        claim_keys = [key for name in lists for key in (name, keys.preempt_claims(name))]
        try:
            index = int(self._claim(keys=claim_keys, args=args))
        except redis.RedisError as exc:  # no claim, no preemption: the next look tries again
            logger.warning("could not claim waiting work for job %s to make way: %s", job_id, exc)
            index = 0
        with self._lock:
            if not index:
                self._refused[job_id] = look
                return None
            claimed = lists[index - 1]
            self._held.pop(claimed, None)
            self._making_way[job_id] = claimed
        return split_level(claimed)[1]

    def tick(self) -> None:
        with self._lock:
            busy = len(self._running)
            lowest = max((level.rank for level in self._running.values()), default=0)
            generation = self._generation
            borrowed = dict(self._borrowed)
        if busy < self._slots or (lowest == 0 and not borrowed):
            # Nothing below the top level (nor borrowed), or a slot is free (or runs a job that
            # is not preemptible): a free slot takes the waiting work itself.
            self._waiting = None
            self._lender_lists, self._lender_count = [], 0
            return
        # The lists of the users waiting beside each queue list (tasks.core.fairshare), not of
        # every user ever seen: one pipelined round trip.
        beside = waiting_users(self._client, list(self._lists()))
        if borrowed:
            self._look_for_lenders(beside, borrowed, generation)
        if lowest == 0:
            self._waiting = None
            return
        above = sorted(((level, listed) for name, users in beside.items() if (level := split_level(name)[1]).rank < lowest
                        for listed in lists_beside(name, users)),
                       key=lambda pair: pair[0].rank)
        lengths = count_waiting(self._client, [name for _, name in above])
        waiting = [(level, name) for (level, name), length in zip(above, lengths, strict=True) if length]
        count = sum(int(length) for length in lengths)
        with self._lock:
            if generation != self._generation:
                return  # a job started meanwhile: its look is the next one (running() woke it)
            found = waiting[0][0] if waiting else None
            if found is not None and found != self._waiting:
                logger.info("%s work waits for this device: lower-level work makes way", found.value)
            self._waiting, self._waiting_count, self._waiting_lists = found, count, waiting
            if waiting:
                self._look += 1
            expired = time.monotonic() - self._hold_s
            self._held = {name: held for name, held in self._held.items() if held[1] > expired}

    def _look_for_lenders(self, beside: dict[str, list[str]], borrowed: dict[str, tuple[str, str]],
                          generation: int) -> None:
        """Find the work, at any level, of users other than the borrowers that their caps let run
        on this device (the lists of this worker's queues it waits in): what takes a borrowed
        job's device back. Reads the caps and the live leases only while a borrowed job runs."""
        borrowers = {user for user, _ in borrowed.values()}
        kind = next(iter(borrowed.values()))[1]
        candidates = sorted(((split_level(name)[1], listed) for name, users in beside.items()
                             for listed in user_lists(name, [user for user in users if user not in borrowers])),
                            key=lambda pair: pair[0].rank)
        lengths = count_waiting(self._client, [name for _, name in candidates]) if candidates else []
        found = [(level, name) for (level, name), length in zip(candidates, lengths, strict=True) if length]
        if found:
            caps, uses = read_cap_uses(self._client)
            found = [(level, name) for level, name in found if not blocking(caps, uses, split_user(name)[1], kind)]
        count = sum(int(length) for (_, name), length in zip(candidates, lengths, strict=True)
                    if any(name == kept for _, kept in found))
        with self._lock:
            if generation != self._generation:
                return
            if found and not self._lender_lists:
                logger.info("work of a user under its cap waits for this device: borrowed work makes way")
            self._lender_lists, self._lender_count = found, count
            if found:
                self._look += 1
