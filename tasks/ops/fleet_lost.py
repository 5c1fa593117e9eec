"""A command waiting on the fleet learns, in one line, that the fleet went away.

A producer command (``devicefleet run``, ``sweep``) waits through Celery's result consumer and
redis-py, which retry a lost Redis for about two minutes (right while ``devicefleet up`` or
systemd restarts it) and then raise their own errors with a traceback. :func:`watching_the_fleet`
turns that into :class:`~tasks.core.errors.FleetLost`, and ends the wait early when it knows the
fleet is gone for good: the command found its fleet through the fleet file of a
``devicefleet up`` (no ``DEVICEFLEET_REDIS_URL``), and that launcher has stopped (its fleet file
removed, or its process dead; the launcher removes it before it stops Redis). That check runs
when Celery says it lost Redis (its retry lines, then not shown) and in a thread every
:data:`~tasks.core.defaults.FLEET_CHECK_S` seconds, and interrupts the waiting main thread as a signal would
(:func:`_thread.interrupt_main`: at its next Python instruction).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from celery.backends.asynchronous import E_RETRY_LIMIT_EXCEEDED
from celery.backends.redis import E_LOST
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

from ..core.defaults import FLEET_CHECK_S
from ..core.errors import FleetLost
from ..core.settings import Settings, read_fleet_file, redact_url

logger = logging.getLogger(__name__)

#: The signal the check raises in the main thread (simulated: no signal is sent to the process).
INTERRUPT = signal.SIGUSR1
#: What Celery's result backend logs before each retry of a lost Redis, and where (5.7.0).
_CELERY_RETRIES = E_LOST.split(":", 1)[0]
_CELERY_LOGGER = "celery.backends.redis"


class _LauncherGone(BaseException):
    """Raised in the main thread once the launcher is gone (a BaseException: nothing on the way
    up takes it for an error of its own)."""


@contextmanager
def watching_the_fleet(settings: Settings, what: str) -> Iterator[None]:
    """Wait for ``what`` (a fan-out, a sweep) inside this block: a fleet that goes away ends it
    with :class:`FleetLost` (see the module's docstring).

    Raises:
        FleetLost: the launcher of the fleet stopped, or Redis stayed unreachable past the retries.
    """
    url = settings.resolve_redis_url()
    launcher = None if settings.redis_url else read_fleet_file(settings.fleet_file)
    watched = launcher is not None and threading.current_thread() is threading.main_thread()
    armed = threading.Event()
    stop = threading.Event()

    def on_interrupt(signum: int, frame: FrameType | None) -> None:
        if armed.is_set():
            armed.clear()
            raise _LauncherGone

    def gone() -> bool:
        """Whether the launcher is gone; if so, the main thread is interrupted."""
        assert launcher is not None
        current = read_fleet_file(settings.fleet_file)
        if current is not None and current.pid == launcher.pid:
            return False
        if armed.is_set():
            _thread.interrupt_main(INTERRUPT)
        return True

    def check() -> None:
        while not stop.wait(FLEET_CHECK_S) and not gone():
            pass

    def retries(record: logging.LogRecord) -> bool:
        """Celery's retry lines show while the launcher lives (a Redis it restarts), not after."""
        return not (armed.is_set() and record.getMessage().startswith(_CELERY_RETRIES) and gone())

    previous = signal.signal(INTERRUPT, on_interrupt) if watched else None
    if watched:
        armed.set()
        logging.getLogger(_CELERY_LOGGER).addFilter(retries)
        threading.Thread(target=check, name="devicefleet-fleet-check", daemon=True).start()
    try:
        yield
    except _LauncherGone:
        assert launcher is not None
        raise FleetLost(f"the fleet stopped while waiting for {what}: its `devicefleet up` (pid {launcher.pid}) "
                        f"ended and took Redis ({redact_url(url)}) with it before every job had reported. "
                        "Start it again with `devicefleet up`, then run again.") from None
    except (RedisConnectionError, OperationalError) as exc:
        raise FleetLost(f"lost the fleet's Redis ({redact_url(url)}) while waiting for {what}, and it did not "
                        f"come back within the retries: {exc}") from None
    except RuntimeError as exc:
        if str(exc) != E_RETRY_LIMIT_EXCEEDED:  # Celery's result consumer used up its retries
            raise
        raise FleetLost(f"lost the fleet's Redis ({redact_url(url)}) while waiting for {what}, and it did not "
                        "come back within the retries (about two minutes)") from None
    finally:
        armed.clear()
        stop.set()
        if watched:
            logging.getLogger(_CELERY_LOGGER).removeFilter(retries)
            signal.signal(INTERRUPT, signal.SIG_DFL if previous is None else previous)
