"""Taking a pack's members from its leader's queue: waiting messages made Celery requests.

A pack's leader (:class:`tasks.worker.modes.pack.Pack`) takes more waiting trials of the queue and
level its own message came from, in one round trip, on a channel of the worker's own (one per
worker, :class:`Siblings`): the transport takes them (:func:`tasks.core.transport.take_waiting`,
the one writer of kombu's bookkeeping beside kombu's own BRPOP and the store of a job's end),
each recorded in kombu's unacked hash and index as kombu records any delivered message, so a
worker that dies holding it gives it back the usual way (the reaper, kombu's visibility timeout). Each becomes a Celery request of the same
job task, executed in a thread of its own (``Request.execute``: Celery's tracer, as the pool
would run it): the member takes its own lease, stores its own result and acknowledges its own
message (:mod:`tasks.worker.runner`), and meets its leader in the room it was seated in.

The members' threads are kept between packs (:class:`MemberThreads`): Celery makes a result
backend per thread, with its own Redis connection pool, so a fresh thread per member opened a
connection (a connect, redis-py's handshake, its version read from the package's metadata) for
each trial, about 4 ms a member here, three times what its lease and its store cost together.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.worker.request import Request

from ..core.defaults import PACK_GATHER_MAX_S, PACK_GATHER_POLL_S, PACK_GATHER_S, PACK_THREAD_IDLE_S
from ..core.priority import Level
from ..core.queue_lists import QueueLists
from ..core.transport import take_waiting
from .pack import Room, Rooms

logger = logging.getLogger(__name__)

class MemberThreads:
    """Daemon threads that run pack members, each kept for the next member until it has waited
    ``idle_s`` for one. A member never waits for a thread: one is started when none is idle (a
    pack's members all run at once, each waiting in its room until the pack ends it)."""

    def __init__(self, name: str, idle_s: float = PACK_THREAD_IDLE_S) -> None:
        self.name = name
        self.idle_s = idle_s
        self._work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # kept threads waiting for work and not reserved by a run()
        self.started = 0

    def run(self, work: Callable[[], None]) -> None:
        """Run ``work`` in an idle kept thread, else in a new one."""
        with self._lock:
            reserved = self._idle > 0
            if reserved:
                self._idle -= 1  # one waiting thread takes what is put
            else:
                self.started += 1
        if reserved:
            self._work.put(work)
        else:
            threading.Thread(target=self._loop, args=(work,), name=f"{self.name}-{self.started}",
                             daemon=True).start()

    def _loop(self, work: Callable[[], None]) -> None:
        while True:
            work()  # the work logs its own failures (Siblings._run)
            with self._lock:
                self._idle += 1
            try:
                work = self._work.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    # Idle too long: leave, unless a run() reserved this thread as the wait ended.
                    if self._idle > 0 and self._work.empty():
                        self._idle -= 1
                        return
                work = self._work.get()


class Siblings:
    """One worker's channel for taking waiting messages of a queue (built on first use), and the
    threads its members run in."""

    def __init__(self, rooms: Rooms, hostname: str) -> None:
        self.rooms = rooms
        self.hostname = hostname
        self.threads = MemberThreads("devicefleet-pack")
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
            lists = QueueLists.waiting(channel.client, queue).of_level(level)
            # A sweep publishes its trials in a burst, and the leader may have come first: go on
            # taking while they still arrive (one more within PACK_GATHER_S), PACK_GATHER_MAX_S at most.
            started = last = time.monotonic()
            while taken < wanted:
                before = taken
                for message in take_waiting(channel, lists, wanted - taken):
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
        self.threads.run(lambda: self._run(request, job_id))

    def _run(self, request: Request, job_id: str) -> None:
        try:
            request.execute()
        except Exception:  # noqa: BLE001  (Celery's tracer stores a task's own failures)
            logger.exception("pack member %s: its request failed outside its job", job_id)
        finally:
            self.rooms.leave(job_id)
