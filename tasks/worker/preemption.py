"""Preemption: work of a higher level that waits for a busy device takes it.

A worker takes the highest level waiting whenever a slot frees (:mod:`tasks.core.priority`); a
long ``batch`` job would still hold its device for hours while ``urgent`` work waits. So while
this worker runs a job below the top level, :class:`Preemption` looks every
:data:`~tasks.core.defaults.PREEMPT_CHECK_S` at the lists of the higher levels of the queues the
worker consumes (one pipelined round trip of ``LLEN``; none while it runs nothing, or only
top-level or non-preemptible jobs). When one holds a message and every slot is busy, the job's
watch (:class:`tasks.worker.runner.JobWatch`) asks the job to make way, once it has run
``preempt_min_run_s`` and unless its options say ``preemptible=False`` (one job per message
waiting: the other slots' jobs run on):

- the job is told: ``ctx.preempted()`` turns true and its next ``ctx.progress()`` raises
  :class:`~tasks.core.errors.Preempted`; a command gets SIGTERM;
- it has ``preempt_grace_s`` to checkpoint and stop, then its process group is ended, as a
  cancelled job's is (:mod:`tasks.worker.supervisor`);
- its message goes back to its queue, as a distributed rank that gives way does: the same id,
  kwargs, options and chord, with ``devicefleet_preemptions`` one more
  (:data:`~tasks.core.keys.PREEMPTIONS_HEADER`). Its lease is released first, so whichever worker
  takes it next takes it at once. No death is counted and ``max_attempts`` is untouched; its
  entry says only ``preemptions``. It runs again (``ctx.attempt``, ``DEVICEFLEET_ATTEMPT`` one
  more) with the same ``artifacts_dir``: ``train`` resumes from its checkpoint there.

The free slot then takes the highest level waiting: the work that preempted the job.

Not preempted: a rank of a distributed job (a gang would have to stop as a whole), and work
waiting in a sweep's own queue is not looked at (only the device's, its kind's, ``fleet`` and
the config's ``extra_queues``).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from ..core.defaults import PREEMPT_CHECK_S
from ..core.periodic import PeriodicThread
from ..core.priority import Level, level_queue

logger = logging.getLogger(__name__)


class Preemption(PeriodicThread):
    """Looks for higher-level work waiting in this worker's queues while it runs lower-level
    jobs; :meth:`outranked` says whether a job must make way."""

    name = "devicefleet-preemption"

    def __init__(self, client: redis.Redis, queues: list[str], slots: int, min_run_s: float,
                 interval_s: float = PREEMPT_CHECK_S) -> None:
        super().__init__(interval_s)
        self._client = client
        self._queues = list(queues)
        self._slots = slots
        self.min_run_s = min_run_s
        self._lock = threading.Lock()
        #: job id -> level of the preemptible jobs this worker runs now
        self._running: dict[str, Level] = {}
        #: The highest level found waiting at the last look taken after every job in
        #: ``_running`` started (None: none, or not looked yet).
        self._waiting: Level | None = None
        #: How many messages of a higher level than the lowest running job's wait (that look).
        self._waiting_count = 0
        #: The jobs asked to make way, until they end: no more are asked than messages wait.
        self._making_way: set[str] = set()
        #: One more per job started: a look sent before a job started does not count for it.
        self._generation = 0

    def running(self, job_id: str, level: Level) -> None:
        """A preemptible job at ``level`` starts: look at once (an earlier look is stale)."""
        with self._lock:
            self._running[job_id] = level
            self._waiting = None
            self._generation += 1
        if level.rank > 0:
            self.wake()

    def done(self, job_id: str) -> None:
        with self._lock:
            self._running.pop(job_id, None)
            self._making_way.discard(job_id)

    def outranked(self, job_id: str, level: Level, started: float) -> Level | None:
        """The higher level whose work waits for this device, if job ``job_id`` at ``level``,
        started at ``started`` (monotonic), must make way for it now; else None. One job is
        asked per waiting message: the others of a device with several slots run on."""
        with self._lock:
            waiting = self._waiting
            if waiting is None or waiting.rank >= level.rank:
                return None
            if time.monotonic() - started < self.min_run_s:
                return None
            if len(self._making_way) >= self._waiting_count:
                return None
            self._making_way.add(job_id)
            return waiting

    def tick(self) -> None:
        with self._lock:
            busy = len(self._running)
            lowest = max((level.rank for level in self._running.values()), default=0)
            generation = self._generation
        if lowest == 0 or busy < self._slots:
            # Nothing below the top level, or a slot is free (or runs a job that is not
            # preemptible): a free slot takes the waiting work itself.
            self._waiting = None
            return
        names = [(level, level_queue(queue, level)) for level in Level if level.rank < lowest
                 for queue in self._queues]
        with self._client.pipeline(transaction=False) as pipe:
            for _, name in names:
                pipe.llen(name)
            lengths = pipe.execute()
        found = next((level for (level, _), length in zip(names, lengths, strict=True) if length), None)
        count = sum(int(length) for length in lengths)
        with self._lock:
            if generation != self._generation:
                return  # a job started meanwhile: its look is the next one (running() woke it)
            if found is not None and found != self._waiting:
                logger.info("%s work waits for this device: lower-level work makes way", found.value)
            self._waiting, self._waiting_count = found, count
