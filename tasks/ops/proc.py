"""Helpers for the child processes the launcher runs (redis-server, workers, Flower)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..core.errors import FleetError

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM ``process``, then SIGKILL it if it is still running after ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
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
