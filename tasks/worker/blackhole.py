"""Black holes (issue 50 item 2): a device on which different jobs fail fast while they succeed
elsewhere is quarantined, and the jobs it failed go back to their shared queue, no attempt spent.

The decision is one script call where the fleet decides a job's end
(:data:`tasks.core.device_state.FAILED_FAST`, beside the state it writes; the store script records
each device's last job ended ok and clears its window): it runs for a job that failed within
:data:`~tasks.core.defaults.BLACKHOLE_FAST_S` of run time, before Celery stores anything, so a
job it sends back to its queue has no failure stored and no chord counts it. A job that fails
fast on two different devices is the job's fault: its failure is stored, as any job's, and no
device is blamed. Not judged: a device group's or a gang's job, a pack's member (their device
is not one alone), a job run in process (no message to send back), a job sent to the device by
name (it could not have run elsewhere: there is nothing to compare).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from ..core.defaults import BLACKHOLE_FAST_S, BLACKHOLE_K, BLACKHOLE_WINDOW_S
from ..core.device_state import failed_fast
from ..core.wire import Outcome
from .accounting import shared_queue
from .device import DeviceWorker
from .supervisor import Ended

logger = logging.getLogger(__name__)

#: How much of a job's error a quarantine's reason keeps, per job.
ERROR_CHARS = 160


def sends_back(worker: DeviceWorker, request: Any, ended: Ended, alone: bool, run_s: float) -> bool:
    """Whether this ending goes back to its queue instead of its failure being stored: a fast
    failure of a job its run mode ran on this device ``alone``
    (:attr:`tasks.worker.modes.base.RunMode.alone`), from a shared queue, that the rule decides
    against the device (:func:`decide`)."""
    queue = shared_queue(request, worker.device.name)
    return (ended.outcome is Outcome.ERROR and run_s < BLACKHOLE_FAST_S and request.id is not None and alone
            and queue != "" and decide(worker, request, ended, queue))


def decide(worker: DeviceWorker, request: Any, ended: Ended, queue: str) -> bool:
    """Record this fast failure (:data:`~tasks.core.device_state.FAILED_FAST`); True when the job goes
    back to its queue instead of its failure being stored. A Redis error stores the failure."""
    device = worker.device.name
    error = ended.error
    text = f"{error.type}: {error.message}" if error is not None else "failed"
    text = " ".join(text.split())[:ERROR_CHARS]
    try:
        decision = failed_fast(
            worker.client, str(request.id), device, text, queue=queue, now=time.time(),
            k=BLACKHOLE_K, window_s=BLACKHOLE_WINDOW_S)
    except redis.RedisError as exc:  # the job's end is stored as it came: nothing blamed
        logger.warning("%s: could not record the fast failure of job %s: %s", device, request.id, exc)
        return False
    if decision.quarantined:
        logger.error("%s quarantined by the fleet: %s", device, decision.quarantined)
        if worker.service is not None:
            worker.service.wake()  # stop taking work now, not at the next read
    return decision.again
