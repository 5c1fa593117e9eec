"""The command job: an existing program run in the job process's place, under its supervision.

The job process starts the command (:class:`CommandJob`) as its child, in its own process group,
so everything the worker does to a job process reaches the command and all it started: a cancel
or a time limit (``StopJob``: SIGTERM to the command's tree, SIGKILL before the worker's grace
runs out), the worker's end (the process group's SIGTERM/SIGKILL, and the parent-death signal).
The job process is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process the command leaves
behind (``nohup sleep &``) is re-parented to it and ended when the command ends.

**The sandbox.** The command sees its device only (``CUDA_VISIBLE_DEVICES``), its cores (the
affinity it inherits, ``OMP_NUM_THREADS``), the working directory its worker config allows, the
producer's ``env``, and none of the worker's ``DEVICEFLEET_*`` settings (the Redis URL may hold a
password). It gets :data:`ENV_ARTIFACTS` (a folder for its files), :data:`ENV_EVENTS`,
:data:`ENV_PARAMS`, :data:`ENV_DEVICE` and :data:`ENV_JOB_ID`.

**Logs.** Its stdout and stderr are read as they come (one selector, never a blocking read of one
stream while the other fills its pipe), kept whole in ``stdout.log`` and ``stderr.log`` in its
artifacts folder, and streamed a batch of lines at a time to ``keys.command_log(job id)``, which
``devicefleet run`` follows. The last lines go into a failure's entry.

**The events protocol** (:class:`EventReader`): the command may write JSON objects, one per line,
to the named pipe at ``$DEVICEFLEET_EVENTS`` (any language: ``echo '{...}' > "$DEVICEFLEET_EVENTS"``):

- ``{"progress": {"step": 3, "total": 10, "value": 0.41}}``: a progress report (bars, Flower;
  ``step`` with ``value`` is an Optuna trial's intermediate value, and a pruned trial's command
  is stopped);
- ``{"scalars": {"loss": 0.41}, "step": 3}``: TensorBoard scalars;
- ``{"output": {"loss": 0.41}}``: fields of the job's output (the objective of a sweep or a study).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import keys
from ..core.children import spawn_child
from ..core.commands import COMMAND_JOB, CommandParams, CommandRules, resolve_command
from ..core.errors import CommandFailed, CommandRefused, GangFailed, JobCancelled
from ..core.job import JobContext, JobDefinition
from ..core.records import GangSpec
from ..core.wire import ProcessSpec

logger = logging.getLogger(__name__)

#: What the command finds in its environment.
ENV_ARTIFACTS = "DEVICEFLEET_ARTIFACTS_DIR"
ENV_EVENTS = "DEVICEFLEET_EVENTS"
ENV_PARAMS = "DEVICEFLEET_PARAMS"
ENV_DEVICE = "DEVICEFLEET_DEVICE"
ENV_JOB_ID = "DEVICEFLEET_JOB_ID"
ENV_LOCAL_RANK = "DEVICEFLEET_LOCAL_RANK"

#: Lines of output a failure's entry carries.
TAIL_LINES = 20
#: Longest line the stream carries (the log files keep every byte).
MAX_LINE_CHARS = 8192
#: How long lines wait to be sent as one batch; the producer sees a line within about this.
FLUSH_INTERVAL_S = 0.05
#: Batches a command's stream keeps (older ones are trimmed; the files keep everything).
STREAM_MAX_BATCHES = 5000
#: How often the loop wakes without output, to look for a stop request or the command's end.
POLL_S = 0.05
#: After the command ends, how long its pipes are read for what is left when something it
#: started still holds them open.
DRAIN_S = 0.5
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
    psutil.wait_procs(alive, timeout=2.0)
    return [c.pid for c in children]


# -- output ----------------------------------------------------------------------------------------


class LogSink:
    """A command's output: whole in ``stdout.log``/``stderr.log``, its last lines kept, and
    batches of lines streamed to Redis (``publish``, None: no stream)."""

    def __init__(self, folder: Path, publish: Callable[[list[list[str]]], None] | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.files = {name: open(folder / f"{name}.log", "wb") for name in ("stdout", "stderr")}  # noqa: SIM115
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lines = 0
        self._partial = {name: b"" for name in self.files}
        self._batch: list[list[str]] = []
        self._last_flush = time.monotonic()
        self._publish = publish

    def write(self, stream: str, data: bytes) -> None:
        """Bytes read from ``stream`` (``stdout`` or ``stderr``)."""
        self.files[stream].write(data)
        *lines, self._partial[stream] = (self._partial[stream] + data).split(b"\n")
        for line in lines:
            self._line(stream, line)

    def _line(self, stream: str, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        self.lines += 1
        self.tail.append(text)
        self._batch.append([stream[3:], text[:MAX_LINE_CHARS]])  # "out" / "err"

    def maybe_flush(self) -> None:
        """Send the batch if it waited long enough."""
        if self._batch and time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        self._last_flush = time.monotonic()
        for handle in self.files.values():
            handle.flush()
        if batch and self._publish is not None:
            try:
                self._publish(batch)
            except Exception as exc:  # noqa: BLE001  (the command matters more than its live view)
                logger.warning("could not stream %d lines of output: %s", len(batch), exc)

    def close(self) -> None:
        """Write out unterminated last lines, send what is left and close the files."""
        for stream, rest in self._partial.items():
            if rest:
                self._line(stream, rest)
        self._partial = {name: b"" for name in self.files}
        self.flush()
        for handle in self.files.values():
            handle.close()


def redis_publisher(client: Any, job_id: str, expires_s: int) -> Callable[[list[list[str]]], None]:
    """A batch of lines to ``keys.command_log(job_id)``: one pipelined round trip."""
    key = keys.command_log(job_id)

    def publish(batch: list[list[str]]) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.xadd(key, {"lines": json.dumps(batch)}, maxlen=STREAM_MAX_BATCHES, approximate=True)
        pipe.expire(key, expires_s)
        pipe.execute()

    return publish


class EventReader:
    """The events protocol (see the module's docstring): lines of JSON from the command."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.output: dict[str, Any] = {}
        self.errors = 0
        self._partial = b""

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if line.strip():
                self.handle(line)

    def handle(self, line: bytes) -> None:
        """One event; a malformed one is counted and logged, never fatal to the command."""
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or not ({"progress", "scalars", "output"} & set(event)):
                raise ValueError("not an object with progress, scalars or output")
            if "progress" in event:
                self.ctx.reporter and self.ctx.reporter(_object(event["progress"], "progress"))
            if "scalars" in event:
                step = event.get("step")
                if not isinstance(step, int) or isinstance(step, bool):
                    raise ValueError(f"scalars need an integer step, got {step!r}")
                self.ctx.log(step, **_object(event["scalars"], "scalars"))
            if "output" in event:
                self.output.update(_object(event["output"], "output"))
        except (ValueError, TypeError) as exc:
            self.errors += 1
            if self.errors <= 5:
                logger.warning("%s: ignored an event of the command (%s): %.200s", self.ctx.device, exc,
                               line.decode(errors="replace"))


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {value!r:.80}")
    return value


@contextlib.contextmanager
def events_pipe() -> Iterator[tuple[str, int]]:
    """A named pipe for the command's events: ``(path, read fd)``. Opened read-write, so the
    reader never sees an end while writers come and go (``echo ... > $DEVICEFLEET_EVENTS``)."""
    folder = tempfile.mkdtemp(prefix="devicefleet-events-")
    path = os.path.join(folder, "events")
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        yield path, fd
    finally:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


# -- running it ------------------------------------------------------------------------------------


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
    #: Called each loop with the elapsed time; returns True to stop without an error
    #: (a gang that moved on).
    watch: Callable[[], bool] = lambda: False
    started: float = field(default=0.0)

    def wait(self) -> Exit:
        process = spawn_child(self.argv, new_session=False, cwd=self.cwd, env=self.env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        self.started = time.monotonic()
        selector = selectors.DefaultSelector()
        assert process.stdout is not None and process.stderr is not None
        streams = {process.stdout.fileno(): "stdout", process.stderr.fileno(): "stderr"}
        for fd in streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        selector.register(self.events_fd, selectors.EVENT_READ)
        stopped: BaseException | None = None
        kill_at: float | None = None
        try:
            while process.poll() is None:
                self._read(selector, streams, POLL_S)
                if stopped is None:
                    stopped = self.should_stop()
                    if stopped is None and self.watch():
                        stopped = _Superseded()
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
            end_descendants(0.5)
            while streams:
                self._read(selector, streams, 0.1)
            self._read(selector, {}, 0)  # the last events
        finally:
            if process.poll() is None:
                _signal_tree(process.pid, signal.SIGKILL)
                process.wait()
            end_descendants(0.5)
            selector.close()
            process.stdout.close()
            process.stderr.close()
            self.sink.close()
        code = process.returncode
        return Exit(code=code if code >= 0 else None, signal=-code if code < 0 else None, stopped=stopped)

    def _read(self, selector: selectors.BaseSelector, streams: dict[int, str], timeout: float) -> None:
        for key, _ in selector.select(timeout):
            fd = int(key.fd)
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


class _Superseded(Exception):
    """The command was stopped because its gang moved to another generation."""


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


# -- the job ---------------------------------------------------------------------------------------


def command_environment(base: dict[str, str], spec: ProcessSpec, ctx: JobContext, params: CommandParams,
                        events_path: str) -> dict[str, str]:
    """What the command's environment holds: the job process's, without the fleet's settings and
    import path, with the producer's ``env`` and the fleet's variables on top."""
    env = {k: v for k, v in base.items() if not k.startswith("DEVICEFLEET_") and k != "PYTHONPATH"}
    env.update(params.env)
    env.update({
        "OMP_NUM_THREADS": str(spec.torch_threads), "MKL_NUM_THREADS": str(spec.torch_threads),
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        ENV_ARTIFACTS: str(ctx.artifacts_dir), ENV_EVENTS: events_path, ENV_DEVICE: spec.device,
        ENV_JOB_ID: ctx.job_id, ENV_PARAMS: json.dumps(params.params),
    })
    env["CUDA_VISIBLE_DEVICES"] = base.get("CUDA_VISIBLE_DEVICES", "-1")
    return env


class CommandJob:
    """The built-in job :data:`COMMAND_JOB` of a job process whose worker allows commands."""

    def __init__(self, spec: ProcessSpec, rules: CommandRules, redis: Callable[[], Any],
                 base_env: dict[str, str]) -> None:
        self.spec = spec
        self.rules = rules
        self.redis = redis
        self.base_env = base_env

    def definition(self) -> JobDefinition:
        return JobDefinition(name=COMMAND_JOB, func=self, params=CommandParams, module=__name__)

    def __call__(self, ctx: JobContext, params: CommandParams) -> dict[str, Any]:
        """Run the command once; its output, or raise how it failed."""
        return self.run(ctx, params, extra_env={}, watch=lambda: False)

    def run(self, ctx: JobContext, params: CommandParams, extra_env: dict[str, str],
            watch: Callable[[], bool]) -> dict[str, Any]:
        """Raises:
            CommandRefused: the program or the folder is not allowed.
            CommandFailed: it exited non-zero or was killed by a signal.
            JobCancelled, JobTimeout, WorkerStopped: the fleet stopped it.
        """
        argv, cwd = resolve_command(params, self.spec.device, self.rules, self.base_env.get("PATH"))
        ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
        client = self.redis()
        publish = redis_publisher(client, ctx.job_id, self.spec.result_expires_s) if client is not None else None
        events = EventReader(ctx)
        with events_pipe() as (events_path, events_fd):
            env = {**command_environment(self.base_env, self.spec, ctx, params, events_path), **extra_env}
            run = CommandRun(argv=argv, cwd=cwd, env=env, sink=LogSink(ctx.artifacts_dir, publish),
                             events=events, events_fd=events_fd, grace_s=max(0.5, self.spec.cancel_grace_s - 1.5),
                             should_stop=lambda: _stop_error(ctx), watch=watch)
            logger.info("%s: running %s in %s", self.spec.device, " ".join(argv), cwd)
            try:
                ended = run.wait()
            except OSError as exc:  # not executable, a bad interpreter line
                raise CommandRefused(f"{argv[0]} could not be started: {exc}") from None
        seconds = time.monotonic() - run.started
        figures: dict[str, Any] = {"argv": argv, "exit_code": ended.code, "signal": _signal_name(ended.signal),
                                   "seconds": round(seconds, 3), "lines": run.sink.lines,
                                   "log": str(ctx.artifacts_dir)}
        if events.errors:
            figures["bad_events"] = events.errors
        if ended.stopped is not None:
            raise ended.stopped
        if not ended.ok:
            tail = list(run.sink.tail)
            raise CommandFailed(
                f"{' '.join(params.formatted_argv())[:200]} {ended.describe()} on {self.spec.device}; last lines:\n"
                + "\n".join(tail[-5:]), command={**figures, "tail": tail})
        return {**events.output, "command": figures}


def _stop_error(ctx: JobContext) -> BaseException | None:
    if ctx.cancelled is None or not ctx.cancelled():
        return None
    if ctx.interruption is not None:
        return ctx.interruption()
    return JobCancelled(f"job {ctx.job_id} on {ctx.device} was cancelled")


def _signal_name(signum: int | None) -> str | None:
    return signal.Signals(signum).name if signum is not None else None


# -- a distributed command ------------------------------------------------------------------------


def run_command_rank(job: CommandJob, ctx: JobContext, params: CommandParams, rdv: Any,
                     address: str) -> dict[str, Any]:
    """One rank of a distributed command: join the gang, host (rank 0) or find its store, run
    the command with torchrun's variables; run it again in the next generation when the gang
    restarts (a peer died, or its collective lost a peer).

    The command finds the store with ``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun: rank
    0's job process hosts it, so no port is picked and raced for. Each worker sees only its own
    device, as ``cuda:0``: ``LOCAL_RANK`` is 0 and ``LOCAL_WORLD_SIZE`` 1, so
    ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` picks it
    (``DEVICEFLEET_LOCAL_RANK`` is the rank's index among the gang's ranks on its host).

    Raises:
        GangFailed: the gang failed (a rank failed, did not come, or no restarts were left).
        CommandFailed: this rank's command failed (the gang fails with it).
    """
    from .distributed import peer_lost_text

    spec: GangSpec = rdv.spec
    gen = rdv.join()
    while True:
        if ctx.cancelled is not None and ctx.cancelled():
            rdv.fail(f"rank {rdv.rank} on {rdv.device} was cancelled")
            raise _stop_error(ctx) or JobCancelled("cancelled")
        assembled = rdv.wait(gen)
        gen = assembled.generation
        address_, port, store = rdv.master(gen, address)
        same_host = [r for r in sorted(assembled.hosts) if assembled.hosts[r] == rdv.host]
        env = {"RANK": str(rdv.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rdv.rank), "MASTER_ADDR": address_,
               "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": str(gen), "TORCHELASTIC_RUN_ID": spec.id,
               "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
               ENV_LOCAL_RANK: str(same_host.index(rdv.rank) if rdv.rank in same_host else 0)}
        watch = _GangWatch(rdv, gen)
        logger.info("%s: rank %d of %d of %s (command), generation %d", rdv.device, rdv.rank,
                    spec.world_size, spec.id, gen)
        try:
            output = job.run(ctx, params, extra_env=env, watch=watch)
        except _Superseded:
            if watch.failed is not None:
                raise GangFailed(f"distributed job {spec.id}: {watch.failed}") from None
            gen = rdv.join()  # the gang moved on: follow it
            continue
        except CommandFailed as exc:
            if watch.failed is not None:
                raise GangFailed(f"distributed job {spec.id}: {watch.failed}") from None
            moved = watch.moved_on()
            tail = exc.command.get("tail")
            if moved or peer_lost_text("\n".join(map(str, tail)) if isinstance(tail, list) else ""):
                logger.warning("%s: rank %d of %s lost a peer in generation %d; restarting with the gang",
                               rdv.device, rdv.rank, spec.id, gen)
                gen = rdv.join() if moved else rdv.join(after=gen)
                continue
            rdv.fail(f"rank {rdv.rank} on {rdv.device} failed: {exc}")
            raise
        except CommandRefused as exc:
            rdv.fail(f"rank {rdv.rank} on {rdv.device} was refused: {exc}")
            raise
        finally:
            del store
        return {**output, "rank": rdv.rank, "world_size": spec.world_size, "restarts": gen}


class _GangWatch:
    """Looks at the gang while a rank's command runs (a few times a second): True once it has
    failed or moved to another generation, so the command is stopped."""

    INTERVAL_S = 0.25

    def __init__(self, rdv: Any, gen: int) -> None:
        self.rdv = rdv
        self.gen = gen
        self.failed: str | None = None
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.INTERVAL_S
        failed, current = self.rdv.client.hmget(self.rdv.key, ["failed", "gen"])
        if failed:
            self.failed = failed.decode() if isinstance(failed, bytes) else str(failed)
            return True
        return current is not None and int(current) != self.gen

    def moved_on(self) -> bool:
        current = self.rdv.client.hget(self.rdv.key, "gen")
        return current is not None and int(current) != self.gen
