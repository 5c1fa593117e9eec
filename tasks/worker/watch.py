"""What a running job's supervisor asks of its worker (:class:`JobWatch`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from celery import Task
from celery.worker import state as worker_state

from ..core.defaults import HEALTH_STOP_GRACE_S, MEMORY_WRITE_S
from ..core.jobstate import Attempt
from ..core.records import JobOptions
from ..core.wire import ModeMessage, Proceed, StopJob, StopReason
from . import progress
from .device import DeviceWorker

logger = logging.getLogger(__name__)


class JobWatch:
    """What a running job's supervisor asks of the worker: publish a report or a command's log
    lines (the job process has no door to Redis: the worker relays them); stop it now?

    A job stops for a :class:`~tasks.core.wire.StopReason`: :meth:`stop` only answers which stop
    is due; :meth:`act_on` does what sending it takes (a preemption's claim on the message it
    makes way for). The stop sent travels into the run's :class:`~tasks.worker.supervisor.Ended`,
    whose outcome :func:`tasks.worker.disposition.settle` matches on.
    """

    def __init__(self, worker: DeviceWorker, task: Task, job_id: str, options: JobOptions, slot: int = 0,
                 attempt: Attempt | None = None, preemptible: bool = True) -> None:
        self.worker = worker
        #: The attempt that holds the job's lease (``None``: run under none): its reports carry its token.
        self.attempt = attempt
        self.task = task
        self.slot = slot
        # Celery's task.request is per thread: keep this job's.
        self.request = task.request
        self.job_id = job_id
        self.time_limit_s = options.time_limit_s or float(worker.config.max_job_seconds)
        self.deadline = time.monotonic() + self.time_limit_s
        self._client = worker.client
        #: Set once a self-fencing stop is sent (:meth:`act_on`): the job's reports are a newer
        #: attempt's business now, and its Redis may be out of reach (:meth:`drain` waits for none).
        self._fenced = threading.Event()
        self.level = options.priority
        # Not where its mode says no (a group's job: its devices would have to stop as a whole; a
        # pack's member: its leader's slot makes way as a whole), nor a job run in process
        # without a message to send back. A gang's rank is: its gang stops as a whole
        # (tasks.worker.gang.GangWatch tells every rank).
        # Work taken over its user's cap (borrowed) is always preemptible: that is its terms.
        borrowed = attempt is not None and attempt.borrowed
        self.preemptible = preemptible and (options.preemptible or borrowed) and attempt is not None
        self.started = time.monotonic()
        self._reports: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._relay: threading.Thread | None = None

    def report(self, fields: dict[str, Any]) -> None:
        """Relay a report, in order, from a thread of its own: the supervisor's loop never waits
        on Redis (a cut-off worker's relay retries for minutes, and the job's stop must not)."""
        if len(self.worker.slots) > 1:  # which of the device's jobs it is (Flower's progress column)
            fields = {**fields, "slot": self.slot}
        if self._relay is None:
            self._relay = threading.Thread(target=self._relay_reports, name=f"devicefleet-reports-{self.slot}",
                                           daemon=True)
            self._relay.start()
        self._reports.put(fields)

    def _relay_reports(self) -> None:
        while (fields := self._reports.get()) is not None:
            if self._fenced.is_set():  # a newer attempt's reports are the job's now
                continue
            published = progress.publish(self.task, self.request, fields, self.worker.heartbeat, self._client,
                                         self.worker.settings.result_expires_s, self.slot, self.attempt,
                                         self.worker.device.name)
            if not published:  # a newer attempt runs the job: this one stops (stop() asks the keeper)
                self.worker.leases.superseded(self.job_id)

    def drain(self) -> None:
        """End the relay of reports, once every report is relayed; a fenced job's are left
        (their relay gives up with its retries)."""
        if self._relay is None:
            return
        self._reports.put(None)
        if not self._fenced.is_set():
            self._relay.join()

    def log(self, lines: Sequence[tuple[str, str]]) -> None:
        progress.publish_log(self._client, self.job_id, lines, self.worker.settings.result_expires_s)

    def heard(self, message: ModeMessage) -> Proceed | None:
        """A plain job has no gang: nothing to publish or fail, nothing to answer."""
        return None

    def memory(self, used: int) -> None:
        # Folded into the next write: the samples come often.
        self.worker.heartbeat.update_slot(self.slot, memory_bytes=used, after_s=MEMORY_WRITE_S)

    def stop(self) -> StopJob | None:
        where = f"job {self.job_id} on {self.worker.device}"
        leases = self.worker.leases
        if (why := leases.must_stop(self.job_id)) is not None:
            return StopJob(job_id=self.job_id, reason=StopReason.FENCED, message=f"{where}: {why}",
                           grace_s=leases.fence_grace_s)
        health = self.worker.health
        if health is not None and (failed := health.failed) is not None:
            return StopJob(job_id=self.job_id, reason=StopReason.DEVICE_FAILED, grace_s=HEALTH_STOP_GRACE_S,
                           message=f"{where}: the device failed ({failed.reason}); it was drained")
        if self.job_id in worker_state.revoked:
            return StopJob(job_id=self.job_id, reason=StopReason.CANCEL, message=f"{where} was cancelled")
        if time.monotonic() > self.deadline:
            return StopJob(job_id=self.job_id, reason=StopReason.TIMEOUT,
                           message=f"{where} ran past its time limit of {self.time_limit_s:g} s")
        return self.slot_stop()

    def slot_stop(self) -> StopJob | None:
        where = f"job {self.job_id} on {self.worker.device}"
        preemption = self.worker.preemption
        if self.preemptible and preemption is not None and \
                (waiting := preemption.outranked(self.job_id, self.level, self.started)) is not None:
            return StopJob(job_id=self.job_id, reason=StopReason.PREEMPT, grace_s=self.worker.config.preempt_grace_s,
                           level=waiting, message=f"{where} ({self.level.value}) made way for {waiting.value} work "
                                                  f"waiting for the device; it goes back to its queue and runs again")
        service = self.worker.service
        if self.preemptible and service is not None and service.hand_back_now:
            return StopJob(job_id=self.job_id, reason=StopReason.PREEMPT, grace_s=self.worker.config.preempt_grace_s,
                           message=f"{where}: its device was drained now ({service.state.reason}); it goes back "
                                   "to its queue and runs again elsewhere")
        if worker_state.should_stop is not None or worker_state.should_terminate is not None:
            self.worker.begin_stop()  # a signal's warm shutdown, before the jobs step hears of it
        if self.worker.stopping_since is not None:
            timeout = self.worker.stop_timeout_s
            if time.monotonic() - self.worker.stopping_since > timeout:
                return StopJob(job_id=self.job_id, reason=StopReason.SHUTDOWN,
                               message=f"{where}: the worker is stopping and the job did not end "
                                       f"within its stop timeout of {timeout:g} s")
        return None

    def act_on(self, stop: StopJob) -> StopJob | None:
        if stop.reason is StopReason.FENCED:
            self._fenced.set()
            logger.error("%s", stop.message)
        elif stop.reason is StopReason.PREEMPT and stop.level is not None:
            # One job per waiting message, across the fleet: the claim decides which one.
            preemption = self.worker.preemption
            if preemption is None or preemption.claim(self.job_id, self.level, self.started) is None:
                return None
        return stop
