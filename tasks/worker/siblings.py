"""Taking a pack's members from its leader's queue: waiting messages made Celery requests.

A pack's leader (:class:`tasks.worker.modes.Pack`) takes more waiting trials of the queue and
level its own message came from. Each is taken with kombu's public ``basic_get`` on a channel of
the worker's own (one per worker, :class:`Siblings`): kombu records it in the unacked hash and
index as it records any delivered message, so a worker that dies holding it gives it back the
usual way (the reaper, kombu's visibility timeout). Each becomes a Celery request of the same
job task, executed in a thread of its own (``Request.execute``: Celery's tracer, as the pool
would run it): the member takes its own lease, stores its own result and acknowledges its own
message (:mod:`tasks.worker.runner`), and meets its leader in the room it was seated in.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Task
from celery.worker.request import Request

from ..core.defaults import PACK_GATHER_MAX_S, PACK_GATHER_POLL_S, PACK_GATHER_S
from ..core.priority import Level
from ..core.queue_lists import QueueLists
from .pack import Room, Rooms

logger = logging.getLogger(__name__)


class Siblings:
    """One worker's channel for taking waiting messages of a queue (built on first use)."""

    def __init__(self, rooms: Rooms, hostname: str) -> None:
        self.rooms = rooms
        self.hostname = hostname
        self._lock = threading.Lock()
        self._connection: Any = None
        self._channel: Any = None

    def take(self, task: Task, room: Room, wanted: int, level: Level) -> int:
        """Take up to ``wanted`` waiting messages of the queue the running ``task``'s message came
        from (its lists of ``level``, the users' lists included), seat each in ``room`` and start
        it in a thread of its own; returns how many it took."""
        queue = (task.request.delivery_info or {}).get("routing_key")
        if not queue:
            return 0
        taken = 0
        with self._lock:
            channel = self._open(task)
            lists = QueueLists.read(channel.client, queue).of_level(level)
            # A sweep publishes its trials in a burst, and the leader may have come first: go on
            # taking while they still arrive (one more within PACK_GATHER_S), PACK_GATHER_MAX_S at most.
            started = last = time.monotonic()
            while taken < wanted:
                before = taken
                for name in lists:
                    while taken < wanted and (message := channel.basic_get(name, no_ack=False)) is not None:
                        self._start(task, room, message)
                        taken += 1
                now = time.monotonic()
                last = now if taken > before else last
                if now - last >= PACK_GATHER_S or now - started >= PACK_GATHER_MAX_S:
                    break
                time.sleep(PACK_GATHER_POLL_S)
        return taken

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.release()
            self._connection = self._channel = None

    def _open(self, task: Task) -> Any:
        if self._channel is None:
            self._connection = task.app.connection_for_read()
            self._channel = self._connection.default_channel
        return self._channel

    def _start(self, task: Task, room: Room, message: Any) -> None:
        name = (message.headers or {}).get("task")
        member_task = task.app.tasks.get(name) if name else None
        job_id = (message.headers or {}).get("id")
        if member_task is None or not isinstance(job_id, str) or name != task.name:
            # Not a trial of this pack's job (a packed sweep's queue holds only its trials):
            # back to its queue, to the consumer that runs it.
            logger.warning("%s: a pack's leader took message %s of %s, not a %s trial; it goes back",
                           self.hostname, job_id, name, task.name)
            message.reject_log_error(logger, self._connection.connection_errors, requeue=True)
            return
        request = Request(message, on_ack=message.ack_log_error, on_reject=message.reject_log_error,
                          hostname=self.hostname, app=task.app, task=member_task,
                          connection_errors=self._connection.connection_errors)
        self.rooms.seat(room, job_id)
        threading.Thread(target=self._run, args=(request, job_id), name=f"devicefleet-pack-{job_id[:8]}",
                         daemon=True).start()

    def _run(self, request: Request, job_id: str) -> None:
        try:
            request.execute()
        except Exception:  # noqa: BLE001  (Celery's tracer stores a task's own failures)
            logger.exception("pack member %s: its request failed outside its job", job_id)
        finally:
            self.rooms.leave(job_id)
