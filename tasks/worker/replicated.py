"""Writes confirmed by replicas: the lease keeper's one connection and its ``WAIT``.

Redis's ``WAIT`` (:meth:`tasks.core.sentinel.Replication.wait`) answers for the writes of its own
connection only: made on another connection of the pool (one whose last write was older, as
another thread's use can leave it), it would confirm a write no replica has. So with replicas
every write this owner confirms and its ``WAIT`` share one connection (redis-py's
single-connection client, on the same pool): a ``WAIT`` covers the owner's last write, the one
asked about or a later one. Without replicas it writes on the pool and ``WAIT`` is never sent.
"""

from __future__ import annotations

import logging
import threading

import redis

from ..core.jobstate import JobState
from ..core.sentinel import Replication

logger = logging.getLogger(__name__)


class ReplicatedWrites:
    """Owns the connection a worker's lease writes go through and their confirmation by replicas.

    :attr:`jobs` is the job-state scripts on that connection; :meth:`confirmed` asks whether the
    replicas have everything written through it so far. The connection is made on first use (it
    connects when made) and given back to its pool by :meth:`close`.
    """

    def __init__(self, client: redis.Redis, replication: Replication | None = None) -> None:
        self._client = client
        self._replication = replication or Replication()
        self._pinned: tuple[redis.Redis, JobState] | None = None  # made on first use: _writer
        self._lock = threading.Lock()

    def _writer(self) -> tuple[redis.Redis, JobState]:
        with self._lock:
            if self._pinned is None:
                writer = self._client.client() if self._replication.replicas > 0 else self._client
                self._pinned = (writer, JobState(writer))
            return self._pinned

    @property
    def jobs(self) -> JobState:
        """The job-state scripts, on the connection :meth:`confirmed` waits on."""
        return self._writer()[1]

    def wait(self, what: str) -> bool:
        """Whether the replicas have this owner's writes (:meth:`Replication.wait`; True at once
        without replicas). A failing ``WAIT`` raises."""
        return self._replication.wait(self._writer()[0], what)

    def confirmed(self, what: str) -> bool:
        """As :meth:`wait`, but False if the ``WAIT`` itself fails (cut off)."""
        try:
            return self.wait(what)
        except redis.RedisError as exc:
            logger.warning("%s: could not ask the replicas: %s", what, exc)
            return False

    def close(self) -> None:
        """Give the owner's own connection (with replicas) back to its pool; made again on next use."""
        with self._lock:
            pinned, self._pinned = self._pinned, None
        if pinned is not None and pinned[0] is not self._client:
            pinned[0].close()
