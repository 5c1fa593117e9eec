"""Child processes that must not outlive the process that starts them.

The launcher's children (redis-server, workers, Flower: :mod:`tasks.ops.proc`) and a worker's
job processes (:mod:`tasks.worker.jobprocess`) are started by :func:`spawn_child`: each leads its
own session, and on Linux asks the kernel for ``SIGKILL`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, see prctl(2)), however the parent ends: a ``SIGKILL`` runs none of
its cleanup. The signal is asked for between fork and exec: a caught signal coming in that
window would be lost while the child still runs its parent's Python handlers; an uncatchable one
cannot be.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

#: From <linux/prctl.h>.
PR_SET_PDEATHSIG = 1
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
#: From <linux/capability.h>: capset(2)'s header version 3 (two 32-bit words per set).
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
#: What a child gets when its parent dies: nobody is left to escalate a signal it could ignore.
PARENT_DEATH_SIGNAL = signal.SIGKILL


def spawn_child(argv: Sequence[str], *, new_session: bool = True, clear_capabilities: bool = False,
                **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **popen_kwargs)`` for a child that must not outlive this process.

    The child leads its own session (``start_new_session``), so that a Ctrl-C in the terminal
    reaches only this process, which stops its children in order, and so that a signal to the
    child's process group reaches everything the child started in it. On Linux it also gets
    :data:`PARENT_DEATH_SIGNAL` when this process dies. ``new_session=False`` keeps the child in
    this process's group instead (a job process's command: a signal to the job process's group
    reaches the command too).

    ``clear_capabilities``: empty the child's capability sets (ambient, then permitted,
    effective and inheritable, with capset(2)) before its ``exec``, so that it starts with none
    whatever this process holds (a worker that starts job processes as other accounts:
    :mod:`tasks.core.accounts`; Linux only). Popen's ``user=`` and ``group=`` change the
    child's ids before this runs.

    Raises:
        OSError, subprocess.SubprocessError: as ``subprocess.Popen`` does.
    """
    preexec = _die_with_parent(clear_capabilities)
    if preexec is None:  # not Linux: only this process's own stop ends the child
        return subprocess.Popen(argv, start_new_session=new_session, **popen_kwargs)
    return _on_lasting_thread(
        lambda: subprocess.Popen(argv, start_new_session=new_session, preexec_fn=preexec, **popen_kwargs))


def _die_with_parent(clear_capabilities: bool = False) -> Callable[[], None] | None:
    """The ``preexec_fn`` that ties a child to this process, or None off Linux.

    It runs in the child between fork and exec, where another thread of the parent may have held
    any lock at fork time (the reason subprocess's documentation calls ``preexec_fn`` unsafe with
    threads). So it only calls what the parent prepared: a ctypes function looked up here (the
    lookup takes the dynamic loader's lock), ``os.getppid`` and ``os._exit``; no import, no logging.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()
    capset = ctypes.CDLL(None, use_errno=True).capset if clear_capabilities else None
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)  # this thread
    no_capabilities = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: each two words of 0

    def tie_to_parent() -> None:
        if capset is not None:
            # EINVAL: a kernel before 4.3 has no ambient set, so nothing to clear there.
            if prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_CLEAR_ALL) failed")
            if capset(header, no_capabilities) != 0:
                raise OSError(ctypes.get_errno(), "capset(2) to no capabilities failed")
        # After Popen's uid change, which clears a parent-death signal asked for before it.
        if prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent may have died before prctl took effect: then no signal ever comes.
        if os.getppid() != parent:
            os._exit(1)

    return tie_to_parent


def die_with_parent(parent: int) -> None:
    """Ask the kernel for :data:`PARENT_DEATH_SIGNAL` when this process's parent dies; exit at
    once when the parent (pid ``parent``) is already gone. For a child started by Python's
    ``multiprocessing`` (no ``preexec_fn`` there), called first thing in the child; a no-op off
    Linux.

    Raises:
        OSError: ``prctl`` failed.
    """
    prctl = _prctl()
    if prctl is None:
        return
    if prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


@functools.cache
def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process (prctl(2):
# "the signal will be sent when that thread terminates"). The main thread lasts as long as the
# process; a supervisor thread (Fleet.supervise on a thread, as the tests run it) does not, and
# the workers it restarted would die with it. So children are forked on the main thread, or on
# one daemon thread that lives as long as the process.
_spawner: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] | None = None
_spawner_lock = threading.Lock()


def _on_lasting_thread(start: Callable[[], T]) -> T:
    """``start()``, on a thread that ends only with the process."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return start()
    with _spawner_lock:
        if _spawner is None:
            _spawner = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_spawner,), name="devicefleet-spawner", daemon=True).start()
        requests = _spawner
    done: Future[T] = Future()
    requests.put((start, done))
    return done.result()


def _serve(requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
    while True:
        start, done = requests.get()
        try:
            done.set_result(start())
        except BaseException as exc:  # handed to the caller's thread, raised there
            done.set_exception(exc)
