"""A device worker obeys its device's service state (:mod:`tasks.core.device_state`, issue 50).

Out of service (drained by an operator, quarantined by the fleet, suspect by its health service)
a worker takes nothing new, and keeps its heartbeat, leases and reaper as before:

- the lease's take script reads the device's state in the same round trip that takes a job
  (:data:`tasks.core.jobscripts.TAKE`): a job that reaches the worker after the drain is refused at
  once, and goes back to the front of its queue (:func:`tasks.worker.admission.of_lease`), no
  attempt spent;
- :class:`ServiceWatch` reads the state every :data:`~tasks.core.defaults.DEVICE_STATE_CHECK_S`
  and, out of service, stops the consumer's BRPOP (:func:`tasks.core.transport.consume`), so the
  queues' waiting jobs go to the other devices instead of bouncing off this one; back in service
  it consumes again;
- a running job finishes, unless the drain said ``--now``: then it is stopped as a preempted job
  is (its grace, then its process group ended) and handed back to its queue, no attempt spent
  (:meth:`tasks.worker.watch.JobWatch.stop`).
"""

from __future__ import annotations

import logging

import redis

from ..core import transport
from ..core.defaults import DEVICE_STATE_CHECK_S
from ..core.device_state import DeviceState, read_state
from ..core.periodic import PeriodicThread

logger = logging.getLogger(__name__)


class ServiceWatch(PeriodicThread):
    """Reads the device's state and starts or stops the consumer by it (see the module)."""

    name = "devicefleet-service"

    def __init__(self, client: redis.Redis, device: str, interval_s: float = DEVICE_STATE_CHECK_S) -> None:
        super().__init__(interval_s)
        self._client = client
        self.device = device
        #: The state last read (``ok`` until the first read).
        self.state = DeviceState(device=device)

    @property
    def hand_back_now(self) -> bool:
        """Running jobs go back to their queue now (drained ``--now``)."""
        return not self.state.in_service and self.state.now

    def start(self) -> None:
        self.tick()  # before the consumer's first BRPOP: a drained device takes nothing at all
        super().start()

    def tick(self) -> None:
        try:
            state = read_state(self._client, self.device)
        except redis.RedisError as exc:  # keep the last state: the take script checks it again
            logger.warning("%s: could not read the device's state: %s", self.device, exc)
            return
        was, self.state = self.state, state
        if was.in_service != state.in_service:
            if state.in_service:
                logger.warning("%s is back in service: taking jobs again", self.device)
            else:
                logger.warning("%s is %s (%s, by %s): taking no new job%s", self.device, state.state, state.reason,
                               state.by, "; handing its running jobs back" if state.now else "")
        transport.consume(state.in_service)

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        transport.consume(True)
