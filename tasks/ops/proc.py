"""Helpers for the child processes the launcher runs (redis-server, workers, Flower)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path


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


def log_tail(path: Path, lines: int = 8, sep: str = "\n") -> str:
    """The last ``lines`` lines of the log at ``path``, joined by ``sep`` (for error messages)."""
    try:
        return sep.join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
