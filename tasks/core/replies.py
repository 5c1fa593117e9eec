"""Redis replies as text: a client made with or without ``decode_responses`` answers ``str`` or
``bytes``; the readers that take either decode with :func:`text`."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """``value``, a reply from Redis (``bytes``, ``str`` or a number), as ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)
