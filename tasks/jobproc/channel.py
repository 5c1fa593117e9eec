"""The job process's end of its pipe to the worker: jobs in, reports, log lines and outcomes out.

A reader thread takes what the worker sends: jobs go to a queue the main thread runs them from,
a stop request is kept for the running job's (or pack member's) next ``ctx.progress()``, a :class:`Proceed`
answers the :meth:`Channel.ask` that waits for it. When the pipe closes (the
worker is gone, however it went), the thread ends this process and everything it started:
nothing a job began may outlive the worker that supervised it.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from multiprocessing.connection import Connection

from pydantic import ValidationError

from ..core.defaults import PACK_REFILL_WAIT_S, RANK_FAILED_ASK_S
from ..core.errors import DeviceFleetError, JobCancelled
from ..core.wire import (
    STOPS,
    Finished,
    Hello,
    LogLines,
    NewMember,
    Proceed,
    ProcessSpec,
    RankFailed,
    Refused,
    Report,
    RunJob,
    RunPack,
    StopJob,
    StopReason,
    StoreOpened,
    WantMember,
    decode_from_worker,
)

logger = logging.getLogger(__name__)

ToWorker = Hello | Refused | Report | LogLines | StoreOpened | RankFailed | Finished | WantMember


class Channel:
    """Both directions of the pipe; :meth:`send` may be called from any thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._jobs: queue.Queue[RunJob | RunPack | None] = queue.Queue()
        #: The stops asked of the running job, or of the running pack's members, by job id.
        self._stops: dict[str, StopJob] = {}
        self._proceed = threading.Event()
        #: The worker's answers to WantMember (one question at a time: the pack's thread asks).
        self._new_members: queue.Queue[NewMember] = queue.Queue()

    def receive_first(self) -> bytes:
        """The first frame (the process spec), read before the reader thread starts."""
        return self._conn.recv_bytes()

    def send(self, message: ToWorker) -> None:
        with self._send_lock:
            self._conn.send_bytes(message.encode())

    def ask(self, message: RankFailed) -> bool:
        """Send ``message`` and wait for the worker's :class:`Proceed` (at most
        :data:`~tasks.core.defaults.RANK_FAILED_ASK_S`); whether it came."""
        self._proceed.clear()
        self.send(message)
        return self._proceed.wait(RANK_FAILED_ASK_S)

    def want_member(self, index: int) -> RunJob | None:
        """Ask the worker for a trial to take the pack's free place ``index``; the member it
        sends, or None (no more, or no answer within :data:`~tasks.core.defaults.PACK_REFILL_WAIT_S`)."""
        self.send(WantMember(index=index))
        try:
            return self._new_members.get(timeout=PACK_REFILL_WAIT_S).member
        except queue.Empty:
            logger.warning("no answer from the worker for a trial to refill place %d of the pack", index)
            return None

    def start(self) -> None:
        threading.Thread(target=self._read, name="devicefleet-jobproc-reader", daemon=True).start()

    def next_job(self) -> RunJob | RunPack | None:
        """The next job or pack to run (blocks); None once the worker has closed the pipe."""
        return self._jobs.get()

    def stop_requested(self, job_id: str) -> bool:
        """Whether the worker asked job ``job_id`` to stop (cheap: one attribute read)."""
        return job_id in self._stops

    def preempted(self, job_id: str) -> bool:
        """Whether the worker asked job ``job_id`` to make way for higher-level work."""
        stop = self._stops.get(job_id)
        return stop is not None and stop.reason is StopReason.PREEMPT

    def interruption(self, job_id: str) -> DeviceFleetError:
        """The error ``ctx.progress()`` raises for the stop the worker asked of ``job_id``
        (:data:`tasks.core.wire.STOPS`)."""
        stop = self._stops.get(job_id)
        if stop is None:
            return JobCancelled(f"job {job_id} was cancelled; it stopped at ctx.progress()")
        error, _ = STOPS[stop.reason]
        return error(stop.message)

    def _read(self) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                self._orphaned()
                return
            try:
                message = decode_from_worker(data)
            except ValidationError as exc:
                logger.error("ignoring a message the worker did not send: %s", exc)
                continue
            self.deliver(message)

    def deliver(self, message: ProcessSpec | RunJob | RunPack | StopJob | Proceed | NewMember) -> None:
        """Take one message from the worker (the reader thread's, or a test's)."""
        if isinstance(message, RunJob | RunPack):
            # A stop was for the run before (a rank runs again under the same job id in
            # its gang's next generation).
            self._stops = {}
            self._jobs.put(message)
        elif isinstance(message, StopJob):
            # A new dict, not an update: the job's thread reads it without a lock.
            self._stops = {**self._stops, message.job_id: message}
        elif isinstance(message, Proceed):
            self._proceed.set()
        elif isinstance(message, NewMember):
            self._new_members.put(message)

    def _orphaned(self) -> None:
        """The worker closed the pipe or died: end this process group (the job process leads
        it: DataLoader workers and subprocesses a job started go too)."""
        self._jobs.put(None)
        logger.info("the worker is gone: ending job process %d and its process group", os.getpid())
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        except OSError:
            os._exit(1)
