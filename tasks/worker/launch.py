"""One run of one job as the runner hands it to its run mode (:mod:`tasks.worker.modes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.records import JobOptions
from ..core.wire import RunJob
from .slots import Slot
from .supervisor import Watch


def _now() -> None:
    """A run whose clock needs no restart (its job starts as it is launched)."""


@dataclass(frozen=True)
class Launch:
    """One run of one job, as the runner hands it to its mode."""

    message: RunJob
    options: JobOptions
    #: The job's own watch: its reports relayed, its stop asked (:class:`tasks.worker.watch.JobWatch`).
    watch: Watch
    slot: Slot
    #: The fencing token of the attempt that holds the job's lease (0: run under none).
    token: int = 0
    #: Called when the job starts later than it was launched (a group, once its devices are held).
    on_start: Callable[[], None] = field(default=_now)
    #: ``siblings(room, n)`` takes up to ``n`` more waiting messages of the queue and level this
    #: job's came from and starts each as a member of ``room`` (a :class:`tasks.worker.pack.Room`:
    #: :meth:`tasks.worker.siblings.Siblings.take`); returns how many it took. None: the job came
    #: from no queue (run in process), or is no packed trial.
    siblings: Callable[[Any, int], int] | None = None
