"""The one background-thread shape the worker uses: do something every interval until stopped."""

from __future__ import annotations

import logging
import threading

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
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Run the next tick now instead of at the end of the interval."""
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
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception as exc:  # Redis away, a bad record: try again next round
                logger.warning("%s: %s: %s", self.name, type(exc).__name__, exc)
