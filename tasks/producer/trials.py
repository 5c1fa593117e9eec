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
- with ``group=k`` (:func:`tasks.sweep`, :func:`tasks.start_study`), sends each trial as the
  job of a device group instead: the groups are chosen once, as a fan-out's
  (:func:`~tasks.core.groups.choose_groups`), and each trial goes to the leader's queue of the
  group with the fewest unfinished trials of this queue, as that group's message (a fresh
  :class:`~tasks.core.records.GroupSpec`: the leader reserves the group's devices and runs it
  in one job process over them, :mod:`tasks.worker.group`). A group's message needs its
  devices named when it is sent, so a group takes a trial when it is sent one, not when it is
  free: the sweep and the study send at most one unfinished trial per group by default, and
  the next as one ends. Each trial's entry names its group (``"device": "cpu0+cpu1"``);
- reads the trials' states and entries with one ``MGET`` of their result keys per poll, and
  their latest progress reports with one more;
- cancels: stores ``REVOKED`` for the trials that have not started (a worker that takes one
  drops it: the id is in its revoked set, and the lease finds the job finished), revokes the
  running ones (they stop at their next ``ctx.progress()``), and purges a sweep's own queue.

Sent with a user's credentials (:mod:`tasks.core.users`), the same, in the user's own keys and
through the workers' relay: the queue's id ends in the user's mark (:func:`~tasks.core.users.owned_id`,
given by the sweep or the study), each trial's task id in ``~<user>`` (its result is a key only
they read); the attach, detach and cancel that Celery's control channel does for the admin are
the user's signed requests to the relay (:mod:`tasks.worker.cancels`), which stores ``REVOKED``
for the trials that do not run; and a cancel empties the user's own list of the sweep's queue,
not the queue (a user may not purge).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from celery import Celery

from ..core.defaults import ATTACH_READ_POLL_S, ATTACH_READ_SLACK_S, CANCEL_RELAY_INTERVAL_S, SWEEP_ATTACH_TIMEOUT_S
from ..core.defaults import SWEEP_REFRESH_S as REFRESH_S
from ..core.devices import DeviceKind
from ..core.errors import ConfigError
from ..core.groups import GroupChoice, check_group_size
from ..core.keys import CANCEL_REQUESTS, sweep_attached
from ..core.priority import DEFAULT_LEVEL, Level
from ..core.queue_lists import USER_SEPARATOR, level_queue, user_list
from ..core.queues import QueueName, device_queue, sweep_queue
from ..core.records import WorkerRecord
from ..core.users import relay_request
from .connections import Connections
from .fanout import JobSpec, credentials_of, group_job, live_devices, placed_groups, revoke
from .reader import RUNNING_STATES, StateReader, device_of, entry_of

__all__ = ["RUNNING_STATES", "TrialQueue", "entry_of", "queue_for", "trial_groups", "trial_task_id"]

logger = logging.getLogger(__name__)

#: Namespace of trial task ids: ``uuid5(TRIAL_NAMESPACE, "<queue id>/<trial>")``.
TRIAL_NAMESPACE = uuid.UUID("5b0d2f57-29a4-4c53-9b39-d9f3b7b5a3c1")


def trial_task_id(queue_id: str, trial: int, user: str | None = None) -> str:
    """The Celery task id of trial ``trial`` of the queue ``queue_id`` (the same in every run),
    ending in ``~<user>`` for a trial sent with ``user``'s credentials (its result is theirs:
    :func:`tasks.core.users.owned_task_id`)."""
    task_id = str(uuid.uuid5(TRIAL_NAMESPACE, f"{queue_id}/{trial}"))
    return task_id if user is None else f"{task_id}{USER_SEPARATOR}{user}"


def queue_for(queue_id: str, devices: list[str], live: Mapping[str, WorkerRecord], *, own: bool = False) -> str:
    """The queue that exactly ``devices`` consume: ``fleet`` for every live device, ``cpu`` or
    ``gpu`` for every device of that kind, else (or with ``own``: placed trials, which a worker
    that joins later must not take) the sweep's own (see the module's docstring)."""
    if own:
        return sweep_queue(queue_id)
    chosen = set(devices)
    if chosen == set(live):
        return QueueName.FLEET.value
    for kind in DeviceKind:
        if chosen == {device for device, record in live.items() if record.kind == kind.value}:
            return kind.value
    return sweep_queue(queue_id)


def trial_groups(chosen: Sequence[str], live: Mapping[str, WorkerRecord], group: int | None,
                 spec: JobSpec, devices: str | Sequence[str]) -> list[GroupChoice] | None:
    """The device groups a sweep's or a study's trials run on (``group=k``), chosen as a
    fan-out's are; None without ``group``.

    Raises:
        ConfigError: ``group`` is not a device count, or the job falls back to the cpu.
        GroupUnavailable: no live host has ``group`` devices of one kind among ``chosen``.
        PlacementUnavailable: the same, when the job has constraints: they are named
            (:func:`~tasks.producer.fanout.placed_groups`).
    """
    if group is None:
        return None
    groups = placed_groups(chosen, live, check_group_size(group), spec, devices)
    if spec.options.fallback is not None or spec.options.gang is not None:
        raise ConfigError(f"group={group}: a device group's job cannot be a gang's rank or fall back "
                          "to the cpu (nothing was sent)")
    return groups


class TrialQueue:
    """The queue of one sweep or study, the devices that consume it, and its trials' results."""

    def __init__(self, app: Celery, queue_id: str, devices: list[str],
                 live: Mapping[str, WorkerRecord], queue: str | None = None,
                 connections: Connections | None = None, level: Level = DEFAULT_LEVEL,
                 groups: list[GroupChoice] | None = None, own: bool = False) -> None:
        self.app = app
        self.connections = connections or Connections.of(app)
        #: The user's credentials the trials are sent with (None: the fleet's own password).
        self.credentials = credentials_of(app)
        #: The trials' states and progress (kept once final).
        self.reader = StateReader(self.connections)
        self.id = queue_id
        #: The queue the trials go to (:func:`queue_for`, or a resumed sweep's).
        self.queue = queue or queue_for(queue_id, devices, live, own=own)
        #: Whether the queue is the sweep's own, which the workers consume only when asked.
        self.own = self.queue == sweep_queue(queue_id)
        #: The trials' level, and the queue's list of that level (what the workers consume).
        self.level = level
        self.list = level_queue(self.queue, level)
        self.devices = devices
        self._workers = {device: live[device] for device in devices}
        self._device_of = {record.worker: device for device, record in live.items()}
        self._refreshed = 0.0
        #: The device groups that run the trials, one trial per message (``group=k``); None:
        #: the trials go to :attr:`queue`. Their keys are then the devices the handle names.
        self.groups = groups
        #: ``{task id: group key}`` of the trials this producer sent to a group.
        self._placed: dict[str, str] = {}
        if groups is not None:
            self.own = False  # each trial goes to its group's leader's own queue
            self.devices = [choice.key for choice in groups]
            for choice in groups:  # a running trial's meta names its leader's worker: the group
                self._device_of[live[choice.devices[0]].worker] = choice.key

    # -- consumers ---------------------------------------------------------------------------

    def attach(self) -> None:
        """Ask every chosen device's worker to consume the sweep's own queue (and wait for their
        replies); nothing to do for a queue they consume anyway."""
        if not self.own:
            return
        nodenames = [record.worker for record in self._workers.values()]
        self._refreshed = time.monotonic()
        if self.credentials is not None:  # the relay asks them, and keeps who answered
            answered = self._relay_attach(nodenames)
        else:
            replies = self.app.control.add_consumer(self.list, destination=nodenames, reply=True,
                                                    timeout=SWEEP_ATTACH_TIMEOUT_S)
            answered = {name for reply in replies or [] for name in reply}
        silent = [d for d, record in self._workers.items() if record.worker not in answered]
        if silent:
            logger.warning("%s: no reply to add_consumer from %s; trials go to the others", self.list,
                           ", ".join(silent))
        self._refreshed = time.monotonic()

    def refresh(self) -> None:
        """Every :data:`REFRESH_S`: a chosen device's worker that restarted (a new process has
        only its own queues) is asked again to consume the queue."""
        if not self.refresh_due():
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
            if self.credentials is not None:
                self._relay("attach", restarted)
            else:
                self.app.control.add_consumer(self.list, destination=restarted, reply=False)

    def detach(self) -> None:
        """Let the workers stop consuming the sweep's own queue (best effort: an empty queue
        costs nothing)."""
        if not self.own:
            return
        try:
            nodenames = [r.worker for r in self._workers.values()]
            if self.credentials is not None:
                self._relay("detach", nodenames)
            else:
                self.app.control.cancel_consumer(self.list, destination=nodenames, reply=False)
        except Exception as exc:  # noqa: BLE001
            logger.debug("%s: cancel_consumer failed: %s", self.queue, exc)

    def _relay_attach(self, nodenames: list[str]) -> set[str]:
        """Ask the workers' relay to attach ``nodenames``; the ones that answered it, read until
        all did or the relay's period and the workers' reply time are over."""
        client, key = self.connections.redis, sweep_attached(self.id)
        client.delete(key)  # an earlier attach's answers (a resumed sweep) are not this one's
        self._relay("attach", nodenames)
        deadline = time.monotonic() + CANCEL_RELAY_INTERVAL_S + SWEEP_ATTACH_TIMEOUT_S + ATTACH_READ_SLACK_S
        while True:
            answered = {name.decode() if isinstance(name, bytes) else str(name) for name in client.smembers(key)}
            if answered >= set(nodenames) or time.monotonic() >= deadline:
                return answered
            time.sleep(ATTACH_READ_POLL_S)

    def _relay(self, action: Literal["attach", "detach"], nodenames: list[str]) -> None:
        """Ask the workers' relay to do ``action`` (attach, detach) on the queue for ``nodenames``."""
        assert self.credentials is not None
        request = relay_request(self.credentials, action, self.list, workers=tuple(nodenames))
        self.connections.redis.lpush(CANCEL_REQUESTS, request.to_json())

    # -- sending -----------------------------------------------------------------------------

    def task_id(self, trial: int) -> str:
        """The task id of trial ``trial`` of this queue (:func:`trial_task_id`)."""
        return trial_task_id(self.id, trial, self.credentials.user if self.credentials is not None else None)

    def send(self, trials: Iterable[tuple[int, JobSpec]]) -> list[int]:
        """Send each ``(trial, spec)`` to the queue under its trial task id; returns the trials."""
        sent: list[int] = []
        with self.app.producer_or_acquire() as producer:
            for trial, spec in trials:
                task_id, queue = self.task_id(trial), self.queue
                if self.groups is not None:
                    choice = self._next_group()
                    spec, queue = group_job(spec, choice, self.connections, self.app), device_queue(choice.devices[0])
                    self._placed[task_id] = choice.key
                spec.signature(self.app, queue).apply_async(task_id=task_id, producer=producer)
                sent.append(trial)
        return sent

    def _next_group(self) -> GroupChoice:
        """The group with the fewest unfinished trials this producer sent it (the first of them)."""
        assert self.groups is not None
        for task_id in [t for t in self._placed if self.reader.is_final(t)]:
            del self._placed[task_id]
        load = {choice.key: 0 for choice in self.groups}
        for key in self._placed.values():
            load[key] += 1
        return min(self.groups, key=lambda choice: load[choice.key])

    # -- reading -----------------------------------------------------------------------------

    def metas(self, task_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        """``{task id: stored meta or None}``: one ``MGET`` for those not final yet."""
        return self.reader.metas(task_ids)

    def reports(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """``{task id: latest progress report}`` of those that reported (one ``MGET``)."""
        return self.reader.reports(task_ids)

    def device_of(self, meta: Mapping[str, Any] | None) -> str | None:
        """The device running or that ran the trial whose meta is ``meta``."""
        return device_of(meta, self._device_of)

    def refresh_due(self) -> bool:
        """Whether :meth:`refresh` has something to do now."""
        return self.own and time.monotonic() - self._refreshed >= REFRESH_S

    # -- cancelling --------------------------------------------------------------------------

    def cancel(self, task_ids: list[str], reason: str) -> None:
        """Queued trials never start; running ones stop at their next ``ctx.progress()``."""
        purged = 0
        if self.own:  # a shared queue holds other work: its trial messages are dropped when taken
            if self.credentials is not None:  # the user's own list of it: theirs to empty, the queue is not
                purged = int(self.connections.redis.delete(user_list(self.list, self.credentials.user)))
            else:
                with self.app.connection_for_write() as conn:
                    purged = conn.default_channel.queue_purge(self.list)
        metas = self.metas(task_ids)
        unfinished = [tid for tid in metas if not self.reader.is_final(tid)]
        if unfinished and self.credentials is not None:
            # The relay revokes them and stores REVOKED for those that do not run.
            revoke(self.app, self.connections.redis, unfinished, store=True)
        elif unfinished:
            # A running trial's worker adds the ids to its revoked set; ctx.progress() sees it.
            self.app.control.revoke(unfinished)
            for tid in unfinished:
                meta = metas[tid]
                if meta is None or meta.get("status") not in RUNNING_STATES:
                    self.app.backend.mark_as_revoked(tid, reason=reason)
        logger.info("%s: cancelled (%s queued trials purged, %d unfinished revoked)", self.queue, purged,
                    len(unfinished))

    def store_revoked(self, task_ids: list[str], reason: str) -> None:
        """Store ``REVOKED`` for trials ``task_ids``, never sent (so that their entries say
        ``cancelled``): with a user's credentials, through the relay."""
        if not task_ids:
            return
        if self.credentials is not None:
            revoke(self.app, self.connections.redis, task_ids, store=True)
            return
        for task_id in task_ids:
            self.app.backend.mark_as_revoked(task_id, reason=reason)
