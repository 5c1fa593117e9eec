"""Helpers for the child processes the launcher runs (redis-server, workers, Flower).

Every child is started by :func:`tasks.core.children.spawn_child`, so that none outlives the
launcher, however the launcher ends (a ``SIGKILL`` runs none of its cleanup): each child gets
``SIGKILL`` when its parent dies. ``SIGKILL`` for all of them, because nobody is left to escalate
a signal that a child may ignore or be slow to obey:

- a worker's ``SIGTERM`` is a warm stop that waits for the running job, for ever if the job hangs,
  and could not store its result anyway with Redis gone too. A killed worker loses no job: its
  message was not acknowledged and the job's lease lapses, so the next start runs it again.
- redis-server hands each command to the kernel (a ``write()`` to its append-only file) before
  it replies, so its death loses nothing a client was told was stored: the final fsync that
  ``SIGTERM`` would add guards against an OS crash, not against a process's death.
- Flower keeps nothing (no ``--persistent``).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..core.defaults import PROCESS_STOP_TIMEOUT_S, WAIT_UNTIL_POLL_S
from ..core.errors import FleetError

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = PROCESS_STOP_TIMEOUT_S) -> None:
    """SIGTERM ``process``, then :func:`kill_group` if it is still running after ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and reap it; when it leads its process group (:func:`tasks.core.children.spawn_child` makes
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
    poll: float = WAIT_UNTIL_POLL_S,
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
