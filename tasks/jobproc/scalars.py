"""A job's scalars (loss curves) as TensorBoard event files, written off the job's thread.

``ctx.log(step, loss=0.3)`` checks the values and appends them to an in-memory buffer: about
2 µs a call here, where tensorboardX's ``add_scalar`` takes about 80 µs, so a job may call it
every step. A background thread drains the buffer once a
second into a ``tensorboardX.SummaryWriter`` (which builds the protobuf records and writes the
event file); closing the log at the job's end drains what is left and closes the file, so the
curve is complete when the job's result arrives.

Each run writes under ``<artifacts>/tensorboard/<job>-<fan-out id>/<device>``: the devices of
one fan-out are sibling runs, which TensorBoard draws side by side
(``tensorboard --logdir <artifacts>/tensorboard``, or ``devicefleet tensorboard``).

tensorboardX, not ``torch.utils.tensorboard``: it writes the same event files but needs only
protobuf and numpy, where torch's writer needs the whole ``tensorboard`` package (the server) in
every worker. The server is an optional extra, for viewing only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..core.defaults import SCALARS_DRAIN_INTERVAL_S as DRAIN_INTERVAL_S
from ..core.defaults import SCALARS_FLUSH_S
from ..core.periodic import PeriodicThread

logger = logging.getLogger(__name__)


def run_dir(tensorboard_root: Path, job: str, fan_out_id: str, device: str) -> Path:
    """The run folder of one job on one device under ``tensorboard_root``
    (:attr:`Settings.tensorboard_path`): sibling devices of a fan-out share a parent."""
    return tensorboard_root / f"{job}-{fan_out_id[:8]}" / device


class _Drainer(PeriodicThread):
    name = "devicefleet-scalars"

    def __init__(self, log: ScalarLog) -> None:
        super().__init__(DRAIN_INTERVAL_S)
        self._log = log

    def tick(self) -> None:
        self._log.drain()


class ScalarLog:
    """One job run's TensorBoard log; the writer and its thread start on the first :meth:`log`."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._pending: deque[tuple[int, dict[str, float], float]] = deque()
        self._writer: Any = None
        self._drainer: _Drainer | None = None
        self._lock = threading.Lock()  # one drain at a time: the thread's or close()'s
        self.points = 0

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Buffer ``scalars`` at ``step`` (numbers only; anything else is a caller's bug)."""
        values = {}
        for tag, value in scalars.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"ctx.log({tag}={value!r}): a scalar must be an int or a float")
            values[tag] = float(value)
        self._pending.append((int(step), values, time.time()))
        if self._drainer is None:
            self._drainer = _Drainer(self)
            self._drainer.start()

    def drain(self) -> None:
        """Write what is buffered into the event file (opened on first use)."""
        with self._lock:
            if not self._pending:
                return
            if self._writer is None:
                from tensorboardX import SummaryWriter  # imported by the first job that logs

                self.logdir.mkdir(parents=True, exist_ok=True)
                self._writer = SummaryWriter(str(self.logdir), flush_secs=SCALARS_FLUSH_S)
            while self._pending:
                step, values, wall_time = self._pending.popleft()
                for tag, value in values.items():
                    self._writer.add_scalar(tag, value, step, walltime=wall_time)
                    self.points += 1

    def close(self) -> None:
        """Stop the thread, write what is left and close the file; never raises (best effort)."""
        if self._drainer is not None:
            self._drainer.stop()
        try:
            self.drain()
            if self._writer is not None:
                self._writer.close()
        except Exception as exc:  # noqa: BLE001  (the job's result matters more than its curves)
            logger.warning("could not write TensorBoard scalars to %s: %s", self.logdir, exc)
