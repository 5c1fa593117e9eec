"""The group host: where a GPU device group's job process runs under systemd, both ends.

Under systemd each GPU worker's unit may open only its own card (``DeviceAllow=``), and a
cgroup below it can only narrow that; so a GPU group's job process, which must open every GPU
of its group, cannot be its leader's child there. It runs instead as a child of the **group
host** (``python -m tasks.worker.group_host SOCKET...``, the ``devicefleet-groups.service``
unit, whose device policy opens every GPU of the host and which runs nothing but group jobs).

Who may ask for such a process is the point: a single-device job runs as the same user as its
worker, in the same mount namespace, so any socket path or secret file the worker could use to
reach the group host, its jobs could use too. Not a file descriptor the worker holds: so the
**leader listens** on a socket systemd created and passed to it
(``devicefleet-worker@gpuN.socket``, socket activation: ``LISTEN_FDS``), in a folder the
worker units cannot see (``InaccessiblePaths=``, so none of their jobs can connect or listen
there), and the **group host connects** to each leader (:func:`serve`). The worker's job
processes do not inherit the listening socket (they are started with ``close_fds``).

The protocol, one JSON message per ``SOCK_SEQPACKET`` packet (its file descriptors attached):

- leader -> host ``{"op": "spawn", "id": n, "env": {...}, "cwd": "..."}``: start a job process
  (``python -P -m tasks.jobproc <fd>``: the host chooses the program, the leader only its
  environment, the group's ``CUDA_VISIBLE_DEVICES`` among it);
- host -> leader ``{"op": "spawned", "id": n, "pid": p}`` with two descriptors: the job
  process's channel and the read end of its output; or ``{"op": "refused", "id": n, "error": ...}``;
- host -> leader ``{"op": "exit", "id": n, "code": c}`` when it ends (``Popen.returncode``).

The leader talks to that process as to its own (:class:`~tasks.worker.jobprocess.JobProcess`,
with a :class:`RemoteChild` for a ``Popen``): it sends its spec and jobs over the channel, reads
its output, measures its memory and ends its process group itself (same user: ``kill`` is
allowed across units). When the leader's connection closes (its worker died), the host ends
that leader's job processes; when the host dies, its job processes get SIGKILL
(:func:`~tasks.core.children.spawn_child`) and their leaders see them gone.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import IO, Any

from ..core.children import spawn_child
from ..core.defaults import GROUP_HOST_CLOSE_S, GROUP_HOST_RECONNECT_S
from ..core.errors import DeviceFleetError
from ..core.shadow import CHILD_FLAGS
from ..core.stopflag import StopFlag

logger = logging.getLogger(__name__)

#: The largest message (a job process's environment is a few KiB).
MAX_MESSAGE = 1 << 20
#: systemd's first passed descriptor (sd_listen_fds(3)).
SD_LISTEN_FDS_START = 3


class GroupHostGone(DeviceFleetError):
    """No group host is connected to this leader, or it went away before it answered."""


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; None at the end of the connection."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def _end(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways, which wakes a thread blocked reading or accepting on it (a
    close would not). Its reader may have closed it already, or its peer gone: both are fine."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# -- the leader's end -----------------------------------------------------------------------------


def inherited_listener(environ: dict[str, str] | None = None) -> socket.socket | None:
    """The listening socket systemd passed this process (``LISTEN_FDS`` and ``LISTEN_PID``, as
    ``sd_listen_fds`` reads them), or None. The variables are removed from ``environ`` (default
    ``os.environ``), so that no child takes them for its own."""
    env = os.environ if environ is None else environ
    count, pid = env.pop("LISTEN_FDS", None), env.pop("LISTEN_PID", None)
    env.pop("LISTEN_FDNAMES", None)
    if count is None or pid != str(os.getpid()) or int(count) < 1:
        return None
    os.set_inheritable(SD_LISTEN_FDS_START, False)
    return socket.socket(fileno=SD_LISTEN_FDS_START)


class RemoteChild:
    """A job process the group host started for this leader, as a ``Popen`` is seen: ``pid``,
    ``stdout``, ``poll()``, ``wait()``, ``returncode``."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self._ended = threading.Event()

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"group host job process {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode


class GroupHostLink:
    """The leader's end: accepts the group host's connection on the listening socket systemd
    passed the worker, and asks it for job processes (:meth:`spawn`)."""

    def __init__(self, listener: socket.socket, label: str) -> None:
        self.label = label
        self._listener = listener
        self._lock = threading.Condition()
        self._conn: socket.socket | None = None
        self._next = 0
        #: By request id: the connection it went out on, and what waits for its answer / its end.
        self._pending: dict[int, tuple[socket.socket, Future[tuple[RemoteChild, socket.socket]]]] = {}
        self._children: dict[int, tuple[socket.socket, RemoteChild]] = {}
        self._closed = StopFlag()
        self._threads = [threading.Thread(target=self._accept, name="devicefleet-group-host", daemon=True)]
        self._threads[0].start()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def disconnect(self) -> None:
        """Close the group host's connection, as the worker's death would: the host ends the
        job processes it started for this leader, and connects again."""
        with self._lock:
            conn = self._conn
        if conn is not None:
            _end(conn)

    def close(self, timeout: float = GROUP_HOST_CLOSE_S) -> None:
        """Stop listening and end the group host's connection (the worker is leaving). The
        listening socket itself is left as it is: under systemd it is the socket unit's, and
        the worker's next start listens on it again."""
        self._closed.set()
        with self._lock:
            conn = self._conn
        if conn is not None:
            _end(conn)
        deadline = time.monotonic() + timeout
        self._threads[0].join(timeout)  # the acceptor first: it adds each connection's reader
        for thread in self._threads[1:]:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                select.select([self._listener.fileno(), self._closed.fileno()], [], [])
                if self._closed.is_set():
                    return
                conn, _ = self._listener.accept()
            except (OSError, ValueError) as exc:  # ValueError: the listening socket was closed
                logger.warning("%s: stopped listening for the group host: %s", self.label, exc)
                return
            with self._lock:
                old, self._conn = self._conn, conn
                self._lock.notify_all()
            if old is not None:  # its reader sees the end (a close would not wake it) and closes it
                _end(old)
            logger.info("%s: the group host connected", self.label)
            reader = threading.Thread(target=self._read, args=(conn,), name="devicefleet-group-host-read", daemon=True)
            reader.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [reader]
            if self._closed.is_set():  # closed as it connected: close() may not have seen it
                _end(conn)

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                message, fds = _receive(conn)
            except (OSError, ValueError) as exc:
                logger.warning("%s: the group host's connection failed: %s", self.label, exc)
                message, fds = None, []
            if message is None:
                break
            ident = int(message.get("id", -1))
            if message.get("op") == "exit":
                with self._lock:
                    _, ended = self._children.pop(ident, (conn, None))
                if ended is not None:
                    ended.ended(int(message["code"]))
                continue
            with self._lock:
                _, future = self._pending.pop(ident, (conn, None))
                if future is not None and message.get("op") == "spawned" and len(fds) == 2:
                    # Known before the next message is read, which may be its exit.
                    child = RemoteChild(int(message["pid"]), os.fdopen(fds[1], "rb"))
                    self._children[ident] = (conn, child)
                    future.set_result((child, socket.socket(fileno=fds[0])))
                    continue
            for fd in fds:
                os.close(fd)
            if future is not None:
                future.set_exception(GroupHostGone(f"{self.label}: the group host refused: "
                                                   f"{message.get('error', message)}"))
        with self._lock:
            if self._conn is conn:
                self._conn = None
            # The host on this connection is gone (its job processes got SIGKILL with it), or was
            # replaced by a new one (which ended the old one's job processes as it left).
            children = [self._children.pop(i)[1] for i, (c, _) in list(self._children.items()) if c is conn]
            pending = [self._pending.pop(i)[1] for i, (c, _) in list(self._pending.items()) if c is conn]
        for child in children:
            child.ended(-signal.SIGKILL)
        for future in pending:
            future.set_exception(GroupHostGone(f"{self.label}: the group host went away before it answered"))
        conn.close()

    def spawn(self, env: dict[str, str], cwd: Path, timeout: float) -> tuple[RemoteChild, socket.socket]:
        """A job process started by the group host with ``env`` in ``cwd``; its channel.

        Raises:
            GroupHostGone: no group host connected within ``timeout``, it refused (the reason is
                the message), or it went away.
        """
        deadline = time.monotonic() + timeout
        future: Future[tuple[RemoteChild, socket.socket]] = Future()
        with self._lock:
            while self._conn is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GroupHostGone(f"{self.label}: no group host connected within {timeout:g} s "
                                        "(is devicefleet-groups.service running?)")
                self._lock.wait(left)
            conn, ident = self._conn, self._next
            self._next += 1
            self._pending[ident] = (conn, future)
        try:
            _send(conn, {"op": "spawn", "id": ident, "env": env, "cwd": str(cwd)})
            return future.result(max(0.0, deadline - time.monotonic()))
        except (OSError, FutureTimeout) as exc:
            with self._lock:
                self._pending.pop(ident, None)
            raise GroupHostGone(f"{self.label}: the group host did not start a job process: {exc!r}") from None


# -- the group host's end -------------------------------------------------------------------------


class _Leader:
    """The group host's connection to one leader and the job processes it started for it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(self.path)
            except OSError:
                conn.close()
                time.sleep(GROUP_HOST_RECONNECT_S)  # the leader is not listening (yet): its unit starts it
                continue
            logger.info("connected to the leader at %s", self.path)
            self._serve(conn)
            self.end_children("its leader's connection closed (the worker stopped or died)")
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        while True:
            try:
                message, fds = _receive(conn)
            except (OSError, ValueError) as exc:
                logger.warning("%s: %s", self.path, exc)
                return
            for fd in fds:
                os.close(fd)  # a leader sends none
            if message is None:
                return
            if message.get("op") == "spawn":
                try:
                    self._spawn(conn, message)
                except OSError as exc:  # its answer could not go: the leader is gone, and a
                    logger.warning("%s: %s", self.path, exc)  # process started for it ends (run)
                    return

    def _spawn(self, conn: socket.socket, message: dict[str, Any]) -> None:
        ident = message.get("id")
        env, cwd = message.get("env"), message.get("cwd")
        if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values()) and isinstance(cwd, str)):
            _send(conn, {"op": "refused", "id": ident, "error": "a spawn needs env (strings) and cwd"})
            return
        ours, theirs = socket.socketpair()
        read, write = os.pipe()
        try:
            popen = spawn_child([sys.executable, *CHILD_FLAGS, "-m", "tasks.jobproc", str(theirs.fileno())],
                                env=env, cwd=cwd if os.path.isdir(cwd) else "/", pass_fds=(theirs.fileno(),),
                                stdin=subprocess.DEVNULL, stdout=write, stderr=subprocess.STDOUT)
        except (OSError, subprocess.SubprocessError) as exc:
            _send(conn, {"op": "refused", "id": ident, "error": f"{type(exc).__name__}: {exc}"})
            for fd in (read, write):
                os.close(fd)
            ours.close()
            return
        finally:
            theirs.close()
        os.close(write)
        with self.lock:
            self.children[popen.pid] = popen
        logger.info("%s: job process %d started (CUDA_VISIBLE_DEVICES=%s)", self.path, popen.pid,
                    env.get("CUDA_VISIBLE_DEVICES"))
        try:
            _send(conn, {"op": "spawned", "id": ident, "pid": popen.pid}, [ours.fileno(), read])
        finally:
            ours.close()
            os.close(read)
        threading.Thread(target=self._wait, args=(conn, ident, popen), daemon=True).start()

    def _wait(self, conn: socket.socket, ident: int, popen: subprocess.Popen[bytes]) -> None:
        code = popen.wait()
        with self.lock:
            self.children.pop(popen.pid, None)
        try:
            _send(conn, {"op": "exit", "id": ident, "code": code})
        except OSError:
            pass  # the leader is gone: nobody waits for it

    def end_children(self, because: str) -> None:
        with self.lock:
            children = list(self.children.values())
        for popen in children:
            logger.info("%s: ending job process %d: %s", self.path, popen.pid, because)
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def serve(paths: Sequence[str]) -> list[_Leader]:
    """Connect to every leader's socket in ``paths`` (again whenever a connection closes) and
    start job processes for them, each on its own thread; returns at once."""
    leaders = [_Leader(path) for path in paths]
    for leader in leaders:
        threading.Thread(target=leader.run, name=f"devicefleet-group-host-{Path(leader.path).stem}",
                         daemon=True).start()
    return leaders


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tasks.worker.group_host SOCKET...``: serve until SIGTERM, then end every job
    process (their leaders see them gone)."""
    paths = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if not paths:
        print("usage: python -m tasks.worker.group_host SOCKET...  (each GPU leader's socket)", file=sys.stderr)
        return 2
    stop = StopFlag()  # threading.Event's set() in a handler can deadlock
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    leaders = serve(paths)
    stop.wait()
    for leader in leaders:
        leader.end_children("the group host is stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
