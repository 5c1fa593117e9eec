"""A plain job: in one of the worker's job processes, in the slot it took."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...core.errors import NoJobProcess
from ...core.wire import RunJob
from ..launch import Launch
from ..slots import Slot
from ..supervisor import Apart, Ended, Supervisor, Watch
from .base import RunMode, no_process


@dataclass(frozen=True)
class Plain(RunMode):
    """A job in one of the worker's job processes, in the slot it took."""

    alone: ClassVar[bool] = True

    supervisor: Supervisor
    #: The device, for the log.
    device: str

    def run(self, launch: Launch) -> Ended:
        return self.in_process(launch.message, launch.watch, launch.slot)

    def in_process(self, job: RunJob, watch: Watch, slot: Slot | None, apart: Apart | None = None) -> Ended:
        """Run ``job`` in one of the worker's job processes (in ``slot``), or ``apart`` in one
        of its own: the plain run that a gang's rank makes once per generation, and a group's
        job in its leader's slot (a GPU group's apart)."""
        try:
            return self.supervisor.run(job, watch, slot, apart)
        except NoJobProcess as exc:
            return no_process(self.device, exc)
