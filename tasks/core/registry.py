"""The live fleet registry, read side: each device worker's record in Redis, under a TTL.

A worker writes ``keys.worker(device)`` (a :class:`~tasks.core.records.WorkerRecord`) from its
heartbeat (:class:`tasks.worker.heartbeat.Heartbeat`) and deletes it on a clean shutdown; a dead
worker's record simply expires. Producers read the registry directly, never waiting on a
broadcast.
"""

from __future__ import annotations

import logging

import redis
from pydantic import ValidationError

from . import keys
from .records import WorkerRecord

logger = logging.getLogger(__name__)


def connect(url: str) -> redis.Redis:
    """A redis-py client for ``url`` that decodes replies to ``str``."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_connect_timeout=5, health_check_interval=30
    )


def _parse(device: str, raw: str | bytes | None) -> WorkerRecord | None:
    if raw is None:
        return None
    try:
        return WorkerRecord.model_validate_json(raw)
    except ValidationError:
        logger.warning("registry record of %s is malformed; ignoring it", device)
        return None


def read_worker(client: redis.Redis, device: str) -> WorkerRecord | None:
    """The record of ``device``'s worker, or None if it has none (or it expired)."""
    return _parse(device, client.get(keys.worker(device)))  # type: ignore[arg-type]


def live_workers(client: redis.Redis) -> dict[str, WorkerRecord]:
    """``{device: record}`` of every worker whose heartbeat has not expired, by device name."""
    devices = sorted(str(d) for d in client.smembers(keys.WORKERS))  # type: ignore[union-attr]
    if not devices:
        return {}
    raws = client.mget([keys.worker(device) for device in devices])
    live: dict[str, WorkerRecord] = {}
    for device, raw in zip(devices, raws, strict=True):  # type: ignore[arg-type]
        record = _parse(device, raw)
        if record is not None:
            live[device] = record
    return live
