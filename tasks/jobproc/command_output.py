"""A command's output and events, as its job process reads them.

**Logs** (:class:`LogSink`): the command's stdout and stderr are kept whole in ``stdout.log`` and
``stderr.log`` in its artifacts folder, its last lines are kept for a failure's entry, and its
lines are streamed a batch at a time to ``keys.command_log(job id)`` (:func:`redis_publisher`),
which ``devicefleet run`` follows (:class:`tasks.producer.commands.LogFollower`).

**The events protocol** (:class:`EventReader`): the command may write JSON objects, one per line,
to the named pipe at ``$DEVICEFLEET_EVENTS`` (any language: ``echo '{...}' > "$DEVICEFLEET_EVENTS"``):

- ``{"progress": {"step": 3, "total": 10, "value": 0.41}}``: a progress report (bars, Flower;
  ``step`` with ``value`` is an Optuna trial's intermediate value, and a pruned trial's command
  is stopped);
- ``{"scalars": {"loss": 0.41}, "step": 3}``: TensorBoard scalars;
- ``{"output": {"loss": 0.41}}``: fields of the job's output (the objective of a sweep or a study).

A line that is not one of these is counted (the output's ``command.bad_events``) and logged,
never fatal to the command.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.defaults import COMMAND_FLUSH_INTERVAL_S as FLUSH_INTERVAL_S
from ..core.job import JobContext

logger = logging.getLogger(__name__)

#: Lines of output a failure's entry carries.
TAIL_LINES = 20
#: Longest line the stream carries (the log files keep every byte).
MAX_LINE_CHARS = 8192
#: Bytes of a line without its end kept before they are sent as a line of their own.
MAX_PARTIAL_BYTES = 1 << 20

class LogSink:
    """A command's output: whole in ``stdout.log``/``stderr.log``, its last lines kept, and
    batches of lines sent to the worker (``publish``, None: no stream)."""

    def __init__(self, folder: Path, publish: Callable[[list[list[str]]], None] | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        # Appended to: a run again of the same job (a gang's restart, a run after its worker
        # died) adds to what the runs before it wrote.
        self.files = {name: open(folder / f"{name}.log", "ab") for name in ("stdout", "stderr")}  # noqa: SIM115
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
        if len(self._partial[stream]) > MAX_PARTIAL_BYTES:  # a line that never ends: sent in pieces
            self._line(stream, self._partial[stream])
            self._partial[stream] = b""

    def _line(self, stream: str, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        # A progress bar redrawn in place (tqdm's "\r"): the line as a terminal ends up showing it.
        text = text.rsplit("\r", 1)[-1]
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
