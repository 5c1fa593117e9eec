"""A device's entry in a fan-out's result dict. Its keys are fixed::

    device, worker, status, output, error, started_at, finished_at, duration_s, visibility
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from typing import Any

ENTRY_KEYS = (
    "device",
    "worker",
    "status",
    "output",
    "error",
    "started_at",
    "finished_at",
    "duration_s",
    "visibility",
)


class EntryStatus(str, Enum):
    OK = "ok"
    ERROR = "error"


def iso(ts: float | None) -> str | None:
    """``ts`` (seconds since the epoch) as an ISO 8601 UTC string."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def error_info(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def make_entry(
    *,
    device: str,
    worker: str | None,
    output: dict[str, Any] | None,
    error: dict[str, str] | None,
    started: float | None,
    finished: float | None,
    visibility: dict[str, Any] | None,
) -> dict[str, Any]:
    """Build an entry; ``status`` is ``error`` exactly when ``error`` is given."""
    return {
        "device": device,
        "worker": worker,
        "status": (EntryStatus.ERROR if error else EntryStatus.OK).value,
        "output": output if not error else None,
        "error": error,
        "started_at": iso(started),
        "finished_at": iso(finished),
        "duration_s": (finished - started) if started is not None and finished is not None else None,
        "visibility": {
            "cuda_visible_devices": (visibility or {}).get("cuda_visible_devices"),
            "cuda_available": (visibility or {}).get("cuda_available"),
            "device_name": (visibility or {}).get("device_name"),
        },
    }
