"""Optuna's Redis journal, on the fleet's own Redis client (plain, or Sentinel).

Optuna's ``JournalRedisBackend`` takes a URL and builds its client with
``redis.Redis.from_url``, which knows no ``sentinel://``. :class:`FleetJournalBackend` is that
backend with the client :func:`tasks.core.registry.connect` makes for any fleet URL (on
Sentinel: one that follows a failover), and each appended entry waits for the fleet's replicas
(:class:`tasks.core.sentinel.Replication`): a journal entry lost in a failover would let the
study's log numbers diverge from what this producer replayed.

Imported only by :func:`tasks.producer.optimize.journal_storage`: Optuna is the ``sweep`` extra.
"""

from __future__ import annotations

import logging
from typing import Any

from optuna.storages.journal import JournalRedisBackend

from ..core.registry import connect
from ..core.sentinel import Replication

logger = logging.getLogger(__name__)


class FleetJournalBackend(JournalRedisBackend):
    """Optuna's Redis journal backend on :func:`~tasks.core.registry.connect`'s client.

    Optuna internals (checked on Optuna 4.0 and 5.0): the backend's ``_redis`` client, rebuilt
    from ``_url`` when the backend is unpickled (``__setstate__``).
    """

    def __init__(self, url: str, prefix: str, replication: Replication | None = None) -> None:
        # Optuna's own constructor with a URL it can parse (its client is made lazily and never
        # used), then the fleet's client in its place.
        super().__init__("redis://", prefix=prefix)
        self._url = url
        self._replication = replication or Replication()
        self._redis = connect(url, decode_responses=False)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._redis = connect(self._url, decode_responses=False)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        super().append_logs(logs)
        self._replication.wait(self._redis, f"{len(logs)} Optuna journal entries")
