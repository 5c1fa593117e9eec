"""Helpers for the child processes the launcher runs (redis-server, workers, Flower).

Every child is started by :func:`spawn_child`, so that none outlives the launcher, however the
launcher ends (a ``SIGKILL`` runs none of its cleanup): on Linux each child asks the kernel for
``SIGKILL`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``, see prctl(2)). ``SIGKILL`` for all
of them, because nobody is left to escalate a signal that a child may ignore or be slow to obey:

- a worker's ``SIGTERM`` is a warm stop that waits for the running job, for ever if the job hangs,
  and could not store its result anyway with Redis gone too. A killed worker loses no job: its
  message was not acknowledged and the job's lease lapses, so the next start runs it again.
- redis-server hands each command to the kernel (a ``write()`` to its append-only file) before
  it replies, so its death loses nothing a client was told was stored: the final fsync that
  ``SIGTERM`` would add guards against an OS crash, not against a process's death.
- Flower keeps nothing (no ``--persistent``).

A caught signal would also be lost if it came between fork and exec, while the child still runs
the launcher's Python ``SIGTERM`` handler; an uncatchable one cannot be.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from ..core.errors import FleetError

T = TypeVar("T")

#: From <linux/prctl.h>.
PR_SET_PDEATHSIG = 1
#: What a child gets when the launcher dies (see the module's docstring for why SIGKILL).
PARENT_DEATH_SIGNAL = signal.SIGKILL


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def spawn_child(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **popen_kwargs)`` for a child that must not outlive this process.

    The child leads its own session (``start_new_session``), so that a Ctrl-C in the terminal
    reaches only the launcher, which stops its children in order, and so that
    :func:`kill_group` reaches everything the child started in its group. On Linux it also gets
    :data:`PARENT_DEATH_SIGNAL` when this process dies.

    Raises:
        OSError, subprocess.SubprocessError: as ``subprocess.Popen`` does.
    """
    preexec = _die_with_parent()
    if preexec is None:  # not Linux: only the launcher's own stop ends the child
        return subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
    return _on_lasting_thread(
        lambda: subprocess.Popen(argv, start_new_session=True, preexec_fn=preexec, **popen_kwargs))


def _die_with_parent() -> Callable[[], None] | None:
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

    def tie_to_parent() -> None:
        if prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent may have died before prctl took effect: then no signal ever comes.
        if os.getppid() != parent:
            os._exit(1)

    return tie_to_parent


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


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM ``process``, then :func:`kill_group` if it is still running after ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and reap it; when it leads its process group (:func:`spawn_child` makes
    it so), SIGKILL the whole group, so that whatever it started in its group goes too."""
    if process.returncode is None:
        # Not reaped yet, so neither its pid nor its group's id can have been reused.
        try:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        except ProcessLookupError:
            pass
    process.wait()


def log_tail(path: Path, lines: int = 8, sep: str = "\n", since: int = 0) -> str:
    """The last ``lines`` lines of the log at ``path`` written after byte offset ``since`` (one
    run's part of a log that several runs append to), joined by ``sep`` (for error messages)."""
    try:
        with path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return sep.join(text.strip().splitlines()[-lines:]) or "(nothing logged)"


def wait_until(
    check: Callable[[], T],
    timeout: float,
    what: str,
    *,
    poll: float = 0.05,
    proc: subprocess.Popen[bytes] | None = None,
    error: type[FleetError] = FleetError,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call ``check`` every ``poll`` seconds until it returns something truthy, and return that.

    ``what`` names what is waited for ("redis-server to answer PING on ..."); ``check`` may
    raise itself (say, when one of several processes exited). ``detail``, called only on failure,
    adds to the message (typically the tail of a log).

    Raises:
        error: ``proc`` exited first, or ``timeout`` seconds passed; the message names ``what``.
    """

    def fail(message: str) -> FleetError:
        return error(f"{message}; {detail()}" if detail is not None else message)

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise fail(f"process {proc.pid} exited with code {proc.returncode} while waiting for {what}")
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)
