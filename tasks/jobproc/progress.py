"""Job progress in the job process: the latest report, sent to the worker a few times a second.

:mod:`tasks.worker.progress` publishes what arrives (the result backend, the progress key, a
task event, the registry).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeGuard

from ..core.defaults import PROGRESS_MIN_INTERVAL_S as MIN_INTERVAL_S

#: ``[step, value]`` pairs every report carries (the latest ones).
VALUES_KEPT = 256


class ProgressThrottle:
    """One running job's progress: the latest report, sent at most every
    :data:`MIN_INTERVAL_S` seconds. A report that came too soon goes out when the interval
    has passed (a timer), or at :meth:`flush` when the job ends, whichever is first: the
    latest report is never left unpublished."""

    def __init__(self, device: str, send: Callable[[dict[str, Any]], None],
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.device = device
        #: Called with each report that goes out (the job process writes it to the worker's pipe).
        self.send = send
        self.min_interval_s = min_interval_s
        self.published = 0
        self._latest: dict[str, Any] | None = None
        self._values: deque[list[float]] = deque(maxlen=VALUES_KEPT)
        self._last_sent = float("-inf")
        self._timer: threading.Timer | None = None
        # Held while a report is taken and sent, so two sends never cross (the timer's and
        # the job's): the last one out is always the latest report.
        self._lock = threading.Lock()

    def report(self, fields: dict[str, Any]) -> None:
        """Keep ``fields`` as the latest report; publish it now if the last one is old enough,
        else when the interval has passed."""
        with self._lock:
            self._latest = {"device": self.device, **fields}
            step, value = fields.get("step"), fields.get("value")
            if _number(step) and _number(value):
                self._values.append([step, value])
            wait = self.min_interval_s - (time.monotonic() - self._last_sent)
            if wait <= 0:
                self._publish()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._trailing)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Publish the latest report if it has not gone out yet (at the job's end)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._publish()

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
            self._publish()

    def _publish(self) -> None:
        meta, self._latest = self._latest, None
        if meta is None:
            return
        self._last_sent = time.monotonic()
        self.published += 1
        if self._values:
            meta["values"] = list(self._values)
        self.send(meta)


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
