"""Every message a producer of this process publishes carries its send time.

The header :data:`tasks.core.keys.SENT_AT_HEADER` gives the age of the oldest message waiting in
a queue (``devicefleet status``, ``devicefleet_queue_oldest_age_seconds``).
"""

from __future__ import annotations

import time
from typing import Any

from celery.signals import before_task_publish

from ..core.keys import SENT_AT_HEADER


@before_task_publish.connect
def stamp_sent_at(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Put the send time in each task message's headers."""
    if headers is not None:
        headers.setdefault(SENT_AT_HEADER, time.time())
