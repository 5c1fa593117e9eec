"""How a device worker stops: warm on the first SIGTERM, at once on a second one or SIGQUIT.

- First ``SIGTERM`` (``systemctl stop``, the launcher's stop): Celery's warm shutdown. The
  worker takes no new job, lets the running one finish within its stop timeout (the worker
  config's ``stop_timeout_s``, default ``max_job_seconds``; then its process is ended and a
  ``WorkerStopped`` entry stored), stores its result, and exits 0.
- A second ``SIGTERM``, or ``SIGQUIT``: stop now. Celery alone cannot do that with the
  ``threads`` pool (a running thread cannot be cancelled, and its cold shutdown waits for it),
  and by default ignores a second SIGTERM. So this module puts every job the worker holds
  back on its queue (they are acknowledged late, so Redis still has them), kills the job
  processes, then exits the process with status 1. The device's next worker, such as the one systemd's
  ``Restart=on-failure`` starts, runs those jobs again from the start.

A ``SIGKILL`` (systemd's last resort after ``TimeoutStopSec``) leaves the message unacknowledged
in Redis, where the broker's visibility timeout brings it back.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from ..core.defaults import REQUEUE_TIMEOUT_S

logger = logging.getLogger(__name__)

#: Exit status of a forced stop: a failure, so ``Restart=on-failure`` starts the worker again.
FORCED_EXIT_STATUS = 1


def requeue_active() -> list[str]:
    """Put every job this worker runs but has not acknowledged back on its queue.

    Returns:
        The ids of the tasks put back.
    """
    from celery.worker import state

    done: list[str] = []
    for request in list(state.active_requests):
        if request.acknowledged:
            continue
        try:
            # The message itself: Request.reject would log and swallow a broker error.
            request.message.reject(requeue=True)
            done.append(str(request.id))
        except Exception as exc:  # the broker is gone: the visibility timeout still returns it
            logger.warning("could not requeue task %s: %s", request.id, exc)
    return done


def force_stop(signum: int, on_exit: Callable[[], None]) -> None:
    """Requeue the running jobs (bounded by :data:`REQUEUE_TIMEOUT_S`), call ``on_exit`` (which
    ends the job processes), and exit at once."""
    name = signal.Signals(signum).name
    requeued: list[str] = []
    # Redis I/O from a thread, never from the signal handler's frame: the interrupted main
    # thread may hold a connection-pool lock.
    worker = threading.Thread(target=lambda: requeued.extend(requeue_active()), daemon=True)
    worker.start()
    worker.join(REQUEUE_TIMEOUT_S)
    logger.warning(
        "%s: stopping at once; requeued %d running job(s): %s", name, len(requeued),
        ", ".join(requeued) or "none",
    )
    on_exit()
    for handler in logging.getLogger().handlers:
        handler.flush()
    # os._exit: interpreter shutdown would wait for the job's (non-daemon) pool thread.
    os._exit(FORCED_EXIT_STATUS)


def install_stop_handlers(on_exit: Callable[[], None]) -> None:
    """Wrap Celery's SIGTERM handler (second SIGTERM forces) and replace its SIGQUIT handler;
    a forced stop calls ``on_exit`` (which ends the job processes) before the process exits.

    Call it after Celery installed its own handlers (:class:`tasks.worker.steps.StopHandlersStep`
    does, at start); outside the main thread (an in-process test worker) signals cannot be
    handled, and nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    celery_term = signal.getsignal(signal.SIGTERM)
    seen = False  # a plain flag: a lock taken in a signal handler can deadlock (tasks.core.stopflag)

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal seen
        if seen:
            force_stop(signum, on_exit)
        seen = True
        logger.warning("SIGTERM: warm shutdown, finishing the running job (again to stop at once)")
        if callable(celery_term):
            celery_term(signum, frame)

    def on_quit(signum: int, frame: FrameType | None) -> None:
        force_stop(signum, on_exit)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGQUIT, on_quit)
