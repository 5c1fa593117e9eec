"""The Xid events each device's health service saw (:mod:`tasks.worker.health`): the one owner of
``keys.XID_COUNTS``' layout, a hash ``{"<device>:<xid>": count}`` with no TTL, which the
exporter serves as ``devicefleet_device_xid_total``."""

from __future__ import annotations

import redis

from . import keys


def count_xid(client: redis.Redis, device: str, xid: int) -> None:
    """One more Xid ``xid`` seen on ``device``."""
    client.hincrby(keys.XID_COUNTS, f"{device}:{xid}", 1)


def read_xid_counts(client: redis.Redis) -> dict[str, dict[int, int]]:
    """``{device: {xid: count}}`` of every Xid ever counted."""
    out: dict[str, dict[int, int]] = {}
    for field, value in client.hgetall(keys.XID_COUNTS).items():  # type: ignore[union-attr]
        name = field.decode() if isinstance(field, bytes) else str(field)
        device, _, xid = name.rpartition(":")
        if device and xid.isdigit():
            out.setdefault(device, {})[int(xid)] = int(value)
    return out
