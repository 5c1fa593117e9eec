"""Trials: many runs of one job through one queue that every chosen device consumes.

What :mod:`tasks.producer.sweep` and :mod:`tasks.producer.optimize` share. A :class:`TrialQueue`

- sends the trials to one queue every chosen device consumes, so a device takes the next trial
  the moment it is free (each worker prefetches one message: a fast GPU runs more trials than a
  CPU worker). When the devices are the whole fleet, or every device of a kind, that is the
  ``fleet``, ``cpu`` or ``gpu`` queue they already consume. Otherwise it is the sweep's own
  ``sweep.<id>``: the chosen devices' workers are asked to consume it (Celery's ``add_consumer``
  control command; a worker's blocking read takes its new queue into account within kombu's
  ``brpop_timeout``, a second), asked again when one restarts, and let go when the trials are
  done (``cancel_consumer``);
- sends trial ``i`` with a task id derived from the queue's id and ``i``, so a producer that
  runs again (a resumed sweep) sends a lost trial under the same id: a second copy of a trial
  that already ran or runs is dropped by the worker's lease (:mod:`tasks.worker.lease`), and
  every trial runs once;
- reads the trials' states and entries with one ``MGET`` of their result keys per poll, and
  their latest progress reports with one more;
- cancels: stores ``REVOKED`` for the trials that have not started (a worker that takes one
  drops it: the id is in its revoked set, and the lease finds the job finished), revokes the
  running ones (they stop at their next ``ctx.progress()``), and purges a sweep's own queue.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery, states

from ..core.backend import entry_of_failure
from ..core.devices import DeviceKind
from ..core.queues import QueueName, sweep_queue
from ..core.records import WorkerRecord
from .fanout import JobSpec, latest_reports, live_devices

logger = logging.getLogger(__name__)

#: Namespace of trial task ids: ``uuid5(TRIAL_NAMESPACE, "<queue id>/<trial>")``.
TRIAL_NAMESPACE = uuid.UUID("5b0d2f57-29a4-4c53-9b39-d9f3b7b5a3c1")
#: Seconds between checks that every chosen device's worker still consumes the queue.
REFRESH_S = 5.0
#: Celery states of a trial a device is running.
RUNNING_STATES = frozenset({states.STARTED, "PROGRESS"})


def trial_task_id(queue_id: str, trial: int) -> str:
    """The Celery task id of trial ``trial`` of the queue ``queue_id`` (the same in every run)."""
    return str(uuid.uuid5(TRIAL_NAMESPACE, f"{queue_id}/{trial}"))


def queue_for(queue_id: str, devices: list[str], live: Mapping[str, WorkerRecord]) -> str:
    """The queue that exactly ``devices`` consume: ``fleet`` for every live device, ``cpu`` or
    ``gpu`` for every device of that kind, else the sweep's own (see the module's docstring)."""
    chosen = set(devices)
    if chosen == set(live):
        return QueueName.FLEET.value
    for kind in DeviceKind:
        if chosen == {device for device, record in live.items() if record.kind == kind.value}:
            return kind.value
    return sweep_queue(queue_id)


class TrialQueue:
    """The queue of one sweep or study, the devices that consume it, and its trials' results."""

    def __init__(self, app: Celery, queue_id: str, devices: list[str],
                 live: Mapping[str, WorkerRecord], queue: str | None = None) -> None:
        self.app = app
        self.id = queue_id
        #: The queue the trials go to (:func:`queue_for`, or a resumed sweep's).
        self.queue = queue or queue_for(queue_id, devices, live)
        #: Whether the queue is the sweep's own, which the workers consume only when asked.
        self.own = self.queue == sweep_queue(queue_id)
        self.devices = devices
        self._workers = {device: live[device] for device in devices}
        self._device_of = {record.worker: device for device, record in live.items()}
        self._refreshed = 0.0
        #: Final metas (SUCCESS, FAILURE, REVOKED) by task id: read once, kept.
        self._final: dict[str, dict[str, Any]] = {}
        #: The latest meta of each trial that has one but has not finished (STARTED, PROGRESS).
        self._running_meta: dict[str, dict[str, Any]] = {}

    # -- consumers ---------------------------------------------------------------------------

    def attach(self) -> None:
        """Ask every chosen device's worker to consume the sweep's own queue (and wait for their
        replies); nothing to do for a queue they consume anyway."""
        if not self.own:
            return
        nodenames = [record.worker for record in self._workers.values()]
        replies = self.app.control.add_consumer(self.queue, destination=nodenames, reply=True, timeout=2.0)
        answered = {name for reply in replies or [] for name in reply}
        silent = [d for d, record in self._workers.items() if record.worker not in answered]
        if silent:
            logger.warning("%s: no reply to add_consumer from %s; trials go to the others", self.queue,
                           ", ".join(silent))
        self._refreshed = time.monotonic()

    def refresh(self) -> None:
        """Every :data:`REFRESH_S`: a chosen device's worker that restarted (a new process has
        only its own queues) is asked again to consume the queue."""
        if not self.own or time.monotonic() - self._refreshed < REFRESH_S:
            return
        self._refreshed = time.monotonic()
        try:
            live = live_devices(self.app)
        except Exception as exc:  # noqa: BLE001  (a registry read that fails is tried again later)
            logger.debug("%s: registry read failed: %s", self.queue, exc)
            return
        restarted = [record.worker for device, record in live.items() if device in self._workers
                     and not record.same_process(self._workers[device].host, self._workers[device].pid)]
        for device, record in live.items():
            self._device_of[record.worker] = device
            if device in self._workers:
                self._workers[device] = record
        if restarted:
            logger.info("%s: %s restarted; asking again to consume", self.queue, ", ".join(restarted))
            self.app.control.add_consumer(self.queue, destination=restarted, reply=False)

    def detach(self) -> None:
        """Let the workers stop consuming the sweep's own queue (best effort: an empty queue
        costs nothing)."""
        if not self.own:
            return
        try:
            self.app.control.cancel_consumer(self.queue, destination=[r.worker for r in self._workers.values()],
                                             reply=False)
        except Exception as exc:  # noqa: BLE001
            logger.debug("%s: cancel_consumer failed: %s", self.queue, exc)

    # -- sending -----------------------------------------------------------------------------

    def send(self, trials: Iterable[tuple[int, JobSpec]]) -> list[int]:
        """Send each ``(trial, spec)`` to the queue under its trial task id; returns the trials."""
        sent: list[int] = []
        with self.app.producer_or_acquire() as producer:
            for trial, spec in trials:
                spec.signature(self.app, self.queue).apply_async(
                    task_id=trial_task_id(self.id, trial), producer=producer)
                sent.append(trial)
        return sent

    # -- reading -----------------------------------------------------------------------------

    def metas(self, task_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        """``{task id: stored meta or None}``: one ``MGET`` for those not final yet."""
        todo = [tid for tid in task_ids if tid not in self._final]
        if todo:
            for tid, meta in zip(todo, self.app.backend.metas(todo), strict=True):
                if meta is not None and meta.get("status") in states.READY_STATES:
                    self._final[tid] = meta
                    self._running_meta.pop(tid, None)
                elif meta is not None:
                    self._running_meta[tid] = meta
                else:
                    self._running_meta.pop(tid, None)
        return {tid: self._final.get(tid) or self._running_meta.get(tid) for tid in task_ids}

    def reports(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """``{task id: latest progress report}`` of those that reported (one ``MGET``)."""
        return latest_reports(self.app, task_ids)

    def device_of(self, meta: Mapping[str, Any] | None) -> str | None:
        """The device running or that ran the trial whose meta is ``meta``."""
        if not meta:
            return None
        result = meta.get("result")
        if isinstance(result, dict) and isinstance(result.get("device"), str) and result["device"]:
            return str(result["device"])
        worker = meta.get("worker") or (result.get("hostname") if isinstance(result, dict) else None)
        if isinstance(worker, str):
            return self._device_of.get(worker, worker.split("@", 1)[0])
        return None

    # -- cancelling --------------------------------------------------------------------------

    def cancel(self, task_ids: list[str], reason: str) -> None:
        """Queued trials never start; running ones stop at their next ``ctx.progress()``."""
        purged = 0
        if self.own:  # a shared queue holds other work: its trial messages are dropped when taken
            with self.app.connection_for_write() as conn:
                purged = conn.default_channel.queue_purge(self.queue)
        metas = self.metas(task_ids)
        unfinished = [tid for tid, meta in metas.items() if tid not in self._final]
        if unfinished:
            # A running trial's worker adds the ids to its revoked set; ctx.progress() sees it.
            self.app.control.revoke(unfinished)
        for tid in unfinished:
            meta = metas[tid]
            if meta is None or meta.get("status") not in RUNNING_STATES:
                self.app.backend.mark_as_revoked(tid, reason=reason)
        logger.info("%s: cancelled (%s queued trials purged, %d unfinished revoked)", self.queue, purged,
                    len(unfinished))


def entry_of(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The device entry of a finished trial's meta; None while it has not finished."""
    if not meta or meta.get("status") not in states.READY_STATES:
        return None
    if meta["status"] == states.SUCCESS and isinstance(meta.get("result"), dict):
        return dict(meta["result"])
    entry = entry_of_failure(meta.get("result"))
    if not entry.get("device"):
        entry["device"] = None  # cancelled before any device took it
    return entry
