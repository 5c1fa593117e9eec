"""The live fleet registry: each worker records itself in Redis under a key with a TTL.

A worker writes ``devicefleet:worker:<device>`` (JSON) every ``heartbeat_interval_s``, with a
TTL of ``heartbeat_ttl_s``, and deletes it on a clean shutdown; a dead worker's entry simply
expires. Producers read the registry directly, without waiting on a broadcast reply.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

logger = logging.getLogger(__name__)

KEY_PREFIX = "devicefleet:worker:"
INDEX_KEY = "devicefleet:workers"


def worker_key(device: str) -> str:
    return f"{KEY_PREFIX}{device}"


def connect(url: str) -> redis.Redis:
    """A redis-py client for ``url`` that decodes replies to ``str``."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_connect_timeout=5, health_check_interval=30
    )


def live_workers(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """``{device: record}`` of every worker whose heartbeat has not expired."""
    devices = sorted(str(d) for d in client.smembers(INDEX_KEY))  # type: ignore[union-attr]
    if not devices:
        return {}
    records = client.mget([worker_key(device) for device in devices])
    live: dict[str, dict[str, Any]] = {}
    for device, raw in zip(devices, records, strict=True):
        if raw is None:
            continue
        try:
            live[device] = json.loads(raw)
        except ValueError:
            logger.warning("registry entry of %s is not JSON; ignoring it", device)
    return live


class Heartbeat:
    """Keeps one worker's registry entry alive from a background thread.

    The record is a dict; :meth:`update` changes fields (for example the job running now) and
    wakes the thread, which writes them at once, so producers see a state change without
    waiting for the next beat, and the job's own thread never waits on Redis for it (two
    registry writes per job were a third of a no-op job's time: ``devicefleet bench``).
    """

    def __init__(
        self, client: redis.Redis, record: dict[str, Any], interval_s: float, ttl_s: float
    ) -> None:
        self._client = client
        self._record = dict(record)
        self._interval = interval_s
        self._ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dirty = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devicefleet-heartbeat", daemon=True)

    @property
    def client(self) -> redis.Redis:
        """The Redis client the heartbeat writes with."""
        return self._client

    @property
    def device(self) -> str:
        return str(self._record["device"])

    def start(self) -> None:
        self._write()
        self._client.sadd(INDEX_KEY, self.device)
        self._thread.start()

    def update(self, **fields: Any) -> None:
        """Change fields of the record; the heartbeat thread writes them within moments."""
        with self._lock:
            self._record.update(fields)
        if self._thread.is_alive():
            self._dirty.set()
        else:
            self._write()

    def stop(self) -> None:
        """Stop beating and remove the entry: the device leaves the fleet now."""
        self._stop.set()
        self._dirty.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 1)
        try:
            pipe = self._client.pipeline()
            pipe.delete(worker_key(self.device))
            pipe.srem(INDEX_KEY, self.device)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("could not remove %s from the registry: %s", self.device, exc)

    def _write(self) -> None:
        # The SET happens under the lock too: otherwise a beat that serialised the record just
        # before an update() could land after it and bring back stale fields.
        with self._lock:
            self._record["heartbeat_at"] = time.time()
            payload = json.dumps(self._record)
            self._client.set(worker_key(self.device), payload, px=self._ttl_ms)

    def _run(self) -> None:
        next_beat = time.monotonic() + self._interval
        while True:
            self._dirty.wait(max(0.0, next_beat - time.monotonic()))
            if self._stop.is_set():
                return
            self._dirty.clear()
            beat = time.monotonic() >= next_beat
            try:
                self._write()
                if beat:
                    next_beat = time.monotonic() + self._interval
                    self._client.sadd(INDEX_KEY, self.device)
            except redis.RedisError as exc:
                # Keep beating: Redis may be restarting, and the entry comes back with it.
                logger.warning("heartbeat of %s failed: %s", self.device, exc)
