"""A command's process and everything it starts, from its start to its reaped end.

The command is the job process's child, in the job process's own process group, so what the
worker does to a job process reaches the command and all it started (the group's SIGTERM and
SIGKILL, the parent-death signal). When the fleet stops it (a cancel, a time limit, the
worker's stop), :class:`CommandRun` sends SIGTERM to its whole tree, and SIGKILL before the
worker's grace runs out, so the job process outlives it and stays warm. The job process is a
child subreaper (:func:`become_subreaper`): a process the command leaves behind
(``nohup sleep &``) is re-parented to it and ended when the command ends.

Both output pipes and the events pipe are read by one selector, as data comes: never a blocking
read of one stream while the other fills its pipe (submitit's deadlock on heavy stderr).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.children import spawn_child
from ..core.defaults import COMMAND_DESCENDANTS_GRACE_S, COMMAND_REAP_S
from ..core.defaults import COMMAND_DRAIN_S as DRAIN_S
from ..core.defaults import COMMAND_POLL_S as POLL_S
from .command_output import EventReader, LogSink

logger = logging.getLogger(__name__)

#: From <linux/prctl.h>.
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Exit:
    """How a command process ended."""

    code: int | None
    signal: int | None
    #: Set when the fleet stopped it (cancelled, timed out): the error to raise.
    stopped: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.stopped is None

    def describe(self) -> str:
        if self.signal is not None:
            return f"was killed by {signal.Signals(self.signal).name} (signal {self.signal})"
        return f"exited with status {self.code}"


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux); False where it cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def end_descendants(grace_s: float) -> list[int]:
    """SIGTERM every descendant of this process, SIGKILL those left after ``grace_s``; reaped.
    Returns their pids."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=COMMAND_REAP_S)
    return [c.pid for c in children]


@dataclass
class CommandRun:
    """One command process, read until it ends; :meth:`wait` returns its :class:`Exit`."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]
    sink: LogSink
    events: EventReader
    events_fd: int
    #: Seconds between SIGTERM and SIGKILL when the fleet stops it.
    grace_s: float
    #: Called each loop: an error to stop the command with (cancelled, timed out), else None.
    should_stop: Callable[[], BaseException | None]
    started: float = field(default=0.0)

    def wait(self) -> Exit:
        try:
            process = spawn_child(self.argv, new_session=False, cwd=self.cwd, env=self.env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        except OSError:  # not executable, a bad interpreter line: nothing ran
            self.sink.close()
            raise
        self.started = time.monotonic()
        selector = selectors.DefaultSelector()
        assert process.stdout is not None and process.stderr is not None
        streams = {process.stdout.fileno(): "stdout", process.stderr.fileno(): "stderr"}
        for fd in streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        selector.register(self.events_fd, selectors.EVENT_READ)
        # Readable when the command exits: the loop wakes at its end, not at its next poll.
        exited = _pidfd(process.pid)
        if exited is not None:
            selector.register(exited, selectors.EVENT_READ)
        stopped: BaseException | None = None
        kill_at: float | None = None
        try:
            while process.poll() is None:
                self._read(selector, streams, POLL_S)
                if stopped is None:
                    stopped = self.should_stop()
                    if stopped is not None:
                        logger.info("stopping command %s: %s", self.argv[0], stopped)
                        _signal_tree(process.pid, signal.SIGTERM)
                        kill_at = time.monotonic() + self.grace_s
                elif kill_at is not None and time.monotonic() >= kill_at:
                    _signal_tree(process.pid, signal.SIGKILL)
                    kill_at = None
            # What it wrote before it ended; something it started may still hold the pipes.
            deadline = time.monotonic() + DRAIN_S
            while streams and time.monotonic() < deadline:
                self._read(selector, streams, 0.02)
            end_descendants(COMMAND_DESCENDANTS_GRACE_S)
            deadline = time.monotonic() + DRAIN_S  # what they left in the pipes
            while streams and time.monotonic() < deadline:
                self._read(selector, streams, 0.02)
            for fd in list(streams):  # held open by a process outside its tree: given up
                selector.unregister(fd)
                del streams[fd]
            while self._read(selector, streams, 0):  # the last events (their writers are gone)
                pass
        finally:
            if process.poll() is None:
                _signal_tree(process.pid, signal.SIGKILL)
                process.wait()
            end_descendants(COMMAND_DESCENDANTS_GRACE_S)
            selector.close()
            if exited is not None:
                os.close(exited)
            process.stdout.close()
            process.stderr.close()
            self.sink.close()
        code = process.returncode
        return Exit(code=code if code >= 0 else None, signal=-code if code < 0 else None, stopped=stopped)

    def _read(self, selector: selectors.BaseSelector, streams: dict[int, str], timeout: float) -> bool:
        """Read what is ready within ``timeout``; whether anything was."""
        ready = selector.select(timeout)
        for key, _ in ready:
            fd = int(key.fd)
            if fd not in streams and fd != self.events_fd:  # the pidfd: the command has exited
                selector.unregister(fd)  # (it stays readable: once is enough)
                continue
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if fd == self.events_fd:
                self.events.feed(data)
            elif data:
                self.sink.write(streams[fd], data)
            else:  # the stream's end
                selector.unregister(fd)
                del streams[fd]
        self.sink.maybe_flush()
        return bool(ready)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when ``pid`` exits (Linux 5.3+), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _signal_tree(pid: int, signum: int) -> None:
    """Send ``signum`` to the command and every process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signum)
