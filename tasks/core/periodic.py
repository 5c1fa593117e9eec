"""The one background-thread shape the worker uses: do something every interval until stopped."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class PeriodicThread:
    """A daemon thread that calls :meth:`tick` every ``interval_s`` (or at once on :meth:`wake`)
    until :meth:`stop`. An exception in a tick is logged and the next tick runs as usual: the
    worker's background duties (heartbeat, leases, reaper) ride through a Redis restart."""

    #: The thread's name, for logs and ``py-spy``.
    name = "devicefleet-periodic"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._asked_lock = threading.Lock()
        self._asked_at: float | None = None  # monotonic time of the earliest tick a wake asked for
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def wake(self, after_s: float = 0.0) -> None:
        """Run the next tick now, or ``after_s`` seconds from now, instead of at the end of the
        interval. Of several wakes before a tick the earliest wins: one tick serves them all."""
        at = time.monotonic() + max(0.0, after_s)
        with self._asked_lock:
            if self._asked_at is None or at < self._asked_at:
                self._asked_at = at
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop ticking; waits up to ``timeout`` seconds (default: one interval + 1) for the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 1 if timeout is None else timeout)

    def tick(self) -> None:
        """One round of work; override."""
        raise NotImplementedError

    def _run(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while True:
            # Cleared before the asked time is read: a wake after this line sets the event
            # again, so the wait below returns at once and the loop reads what it asked for.
            self._wake.clear()
            with self._asked_lock:
                if self._asked_at is not None:
                    next_at = min(next_at, self._asked_at)
                    self._asked_at = None
            if self._stop.is_set():
                return
            wait_s = next_at - time.monotonic()
            if wait_s > 0 and self._wake.wait(wait_s):
                continue  # woken: stopping, or an earlier tick asked for
            next_at = time.monotonic() + self.interval_s
            try:
                self.tick()
            except Exception as exc:  # Redis away, a bad record: try again next round
                logger.warning("%s: %s: %s", self.name, type(exc).__name__, exc)
