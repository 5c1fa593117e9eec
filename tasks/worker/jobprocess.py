"""One job process, seen from the worker: start it, talk to it, end it and everything it started.

A :class:`JobProcess` is ``python -m tasks.jobproc <fd>`` (:mod:`tasks.jobproc`) in a session of
its own, so its process group holds the job and whatever the job starts (DataLoader workers,
subprocesses), and :meth:`JobProcess.kill` ends them all: SIGTERM, then SIGKILL. Its output
(prints, logs, tracebacks) is relayed line by line to the worker's log; the last lines of the
running job are kept for its crash report.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from ..core.accounts import WORKER_CAPABILITIES, JobAccount
from ..core.children import spawn_child
from ..core.defaults import (
    EXIT_STATUS_WAIT_S,
    OUTPUT_RELAY_JOIN_S,
    OUTPUT_TAIL_WAIT_S,
    PROCESS_START_TIMEOUT_S,
    TERM_GRACE_S,
)
from ..core.shadow import CHILD_FLAGS
from ..core.wire import (
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
    StoreOpened,
    WantMember,
    decode_from_job_process,
)
from .group_host import GroupHostGone, GroupHostLink, RemoteChild

logger = logging.getLogger(__name__)

#: Lines of a job's output kept for its crash report.
TAIL_LINES = 20


class ProcessGone(Exception):
    """The job process exited (or closed its pipe), or would not start (``refused`` says why
    when it said so)."""

    def __init__(self, message: str, refused: Refused | None = None) -> None:
        super().__init__(message)
        self.refused = refused


class JobProcess:
    """A started job process; its methods are called by one thread at a time."""

    def __init__(self, spec: ProcessSpec, env: dict[str, str], cwd: Path, label: str,
                 host: GroupHostLink | None = None, start_timeout_s: float = PROCESS_START_TIMEOUT_S,
                 account: JobAccount | None = None) -> None:
        """Start the process: this worker's child, or with ``host`` the group host's
        (:mod:`tasks.worker.group_host`: a GPU group's under systemd), asked for it within
        ``start_timeout_s``. With ``account``, it runs as that user's system account
        (:mod:`tasks.core.accounts`).

        Raises:
            ProcessGone: the group host did not start it, or it cannot start as ``account``.
        """
        self.label = label
        self.popen: subprocess.Popen[bytes] | RemoteChild
        as_account: dict[str, Any] = {}
        if account is not None:
            if host is not None:
                raise ProcessGone(f"{label}: a GPU group's job process under the group host cannot run as "
                                  f"user {account.user}'s system account (job accounts): not supported")
            env = {**env, "HOME": str(account.folder), "USER": account.account, "LOGNAME": account.account}
            as_account = {"user": account.uid, "group": account.gid, "extra_groups": [], "umask": 0o077,
                          "clear_capabilities": True}
        if host is not None:
            try:
                self.popen, ours = host.spawn(env, cwd, start_timeout_s)
            except GroupHostGone as exc:
                raise ProcessGone(str(exc)) from None
        else:
            ours, theirs = socket.socketpair()
            try:
                # Its own session and process group (kill() reaches everything the job starts, and a
                # Ctrl-C on the worker's terminal reaches the worker, which decides), and SIGKILL
                # when the worker dies, however it dies.
                self.popen = spawn_child(
                    # -P: no working directory first on sys.path, so a user's own tasks.py there
                    # cannot shadow devicefleet's package (PYTHONPATH names it first; the working
                    # directory comes after it, for job modules).
                    [sys.executable, *CHILD_FLAGS, "-m", "tasks.jobproc", str(theirs.fileno())],
                    env=env, cwd=cwd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **as_account,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                ours.close()
                if account is None:
                    raise
                raise ProcessGone(f"{label}: could not start a job process as {account.account} (user "
                                  f"{account.user}): {exc}; the worker needs {', '.join(WORKER_CAPABILITIES)} "
                                  "(`devicefleet deploy --job-account` gives them to its unit)") from None
            finally:
                theirs.close()
        self.pid = self.popen.pid
        self._conn = Connection(ours.detach())
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._relay = threading.Thread(target=self._relay_output, args=(self.popen.stdout,),
                                       name=f"devicefleet-jobproc-{self.pid}-output", daemon=True)
        self._relay.start()
        self.hello: Hello | None = None
        #: Why it would not start, if it said so.
        self.refused: Refused | None = None
        #: Jobs this process has run.
        self.jobs_run = 0
        #: The user of the first job it ran (:mod:`tasks.worker.owners`): it runs no other
        #: user's; None until it runs one.
        self.owner: str | None = None
        #: GPU memory it held before its first job (its CUDA context), as the worker's meter
        #: measured it; None until measured.
        self.device_baseline: int | None = None
        #: Why the worker ended it, once it did (``kill``): its exit is then no crash.
        self.killed_because: str | None = None
        try:
            self._conn.send_bytes(spec.encode())
        except OSError as exc:  # it died at once: wait_hello says how, with its output
            logger.debug("%s: could not send the spec: %s", label, exc)

    # -- talking -----------------------------------------------------------------------------

    def wait_hello(self, timeout: float) -> Hello:
        """Wait until the process is ready.

        Raises:
            ProcessGone: it exited or refused (:attr:`refused` says why), or did not say hello in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.receive(max(0.0, deadline - time.monotonic()))
            except ProcessGone as gone:
                tail = self.tail_text()
                self.kill("it exited before it was ready")
                raise ProcessGone(f"{self.label}: the job process exited before it was ready ({gone}); "
                                  f"its output: {tail}") from None
            if isinstance(message, Hello):
                self.hello = message
                return message
            if isinstance(message, Refused):
                self.refused = message
                self.kill("it refused to start")
                raise ProcessGone(f"{self.label}: {message.error.type}: {message.error.message}", message)
            if message is None and time.monotonic() >= deadline:
                self.kill("it did not say hello in time")
                raise ProcessGone(f"{self.label}: not ready after {timeout:g} s; its output: {self.tail_text()}")

    def send(self, message: RunJob | RunPack | StopJob | Proceed | NewMember) -> None:
        """Send ``message``; a process that has gone is found by the next :meth:`receive`."""
        if isinstance(message, RunJob | RunPack):
            self._tail.clear()
            self.jobs_run += 1
        try:
            self._conn.send_bytes(message.encode())
        except OSError as exc:
            logger.debug("%s: could not send %s: %s", self.label, message.kind, exc)

    def receive(self, timeout: float) -> (Hello | Refused | Report | LogLines | StoreOpened | RankFailed | Finished
                                          | WantMember | None):
        """The next message, or None if none came within ``timeout``.

        Raises:
            ProcessGone: the process exited or closed its end of the pipe.
        """
        try:
            if not self._conn.poll(timeout):
                if self.popen.poll() is not None:  # dead, its pipe held open by a child of its own
                    raise ProcessGone(self.exit_text())
                return None
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise ProcessGone(self.exit_text()) from None
        try:
            return decode_from_job_process(data)
        except ValidationError as exc:
            logger.error("%s: ignoring a malformed message from the job process: %s", self.label, exc)
            return None

    # -- ending ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, because: str, term_grace_s: float = TERM_GRACE_S) -> None:
        """End the process and its whole process group: SIGTERM, then SIGKILL after
        ``term_grace_s``; returns once the process is reaped."""
        if self.killed_because is None:
            self.killed_because = because
        if self.alive:
            logger.info("%s: ending job process %d (%s)", self.label, self.pid, because)
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(term_grace_s)
            except subprocess.TimeoutExpired:
                pass
        # SIGKILL the group even when the leader has gone: a DataLoader worker or a subprocess
        # the job started may still hold the device.
        self._signal_group(signal.SIGKILL)
        self.popen.wait()
        self._relay.join(OUTPUT_RELAY_JOIN_S)
        self._conn.close()

    def kill_now(self, because: str) -> None:
        """SIGKILL the process group and wait for nothing (from a signal handler)."""
        if self.killed_because is None:
            self.killed_because = because
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def exit_text(self) -> str:
        """How the process ended: ``killed by SIGSEGV``, ``exit status 3``, or still running."""
        code = self.popen.poll()
        if code is None:
            try:
                code = self.popen.wait(EXIT_STATUS_WAIT_S)
            except subprocess.TimeoutExpired:
                return "closed its pipe but is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (the kernel's out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
            return f"killed by {name}{hint}"
        return f"exit status {code}"

    def tail_text(self) -> str:
        """The last lines the running job printed (waits briefly for the relay to catch up)."""
        if not self.alive:
            self._relay.join(OUTPUT_TAIL_WAIT_S)
        lines = list(self._tail)
        return " | ".join(lines) if lines else "(no output)"

    def rss_growth_bytes(self, rss_bytes: int) -> int:
        """How far ``rss_bytes`` is above the process's resident memory at hello."""
        baseline = self.hello.rss_bytes if self.hello is not None else rss_bytes
        return max(0, rss_bytes - baseline)

    def _relay_output(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        prefix = f"{self.label}[{self.pid}]"
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail.append(line)
                logger.info("%s %s", prefix, line)
        stream.close()
