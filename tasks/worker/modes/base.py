"""What a run mode is (:class:`RunMode`) and the hooks every mode has unless it says otherwise
(:class:`Mode`): the runner asks these, never which mode a job runs in."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ...core.errors import DeviceMismatch, NoJobProcess
from ...core.records import JobOptions
from ..launch import Launch
from ..slots import Slot, Slots
from ..supervisor import Ended

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Seat:
    """Where a job runs on its worker: its ``slot``; whether it may be ``preemptible`` (a
    group's job and a pack's member stop only as a whole); ``own``: the slot is its own (its
    busy state in the registry), not a pack leader's it runs in."""

    slot: Slot
    preemptible: bool = True
    own: bool = True


class RunMode(Protocol):
    """A way to run a job: its own checks before it runs, where it sits, and its run, which
    returns how it ended and never raises for the job's sake."""

    #: Whether its job runs on this device alone: the black-hole rule judges only such a job's
    #: fast failures (:mod:`tasks.worker.blackhole`).
    alone: ClassVar[bool]

    def admit(self, options: JobOptions, mismatch: DeviceMismatch | None) -> DeviceMismatch | None:
        """The mode's own checks of a job with constraints, once this device's were checked
        (``mismatch``: they failed): the refusal its end is stored with; None: it may run."""

    def gated(self, job_id: str) -> bool:
        """Whether the job waits at the gate a device group closes (:class:`tasks.worker.group.GroupGate`)."""

    def seat(self, slots: Slots, job_id: str) -> AbstractContextManager[Seat]:
        """Hold the job's seat for its run."""

    def run(self, launch: Launch) -> Ended:
        """Run ``launch``'s job to its end."""


class Mode:
    """The hooks of a mode that says nothing of its own: no check beyond its device's, it
    waits at the gate, it takes a slot of its own and may be preempted."""

    alone: ClassVar[bool] = False

    def admit(self, options: JobOptions, mismatch: DeviceMismatch | None) -> DeviceMismatch | None:
        return mismatch

    def gated(self, job_id: str) -> bool:
        return True

    @contextmanager
    def seat(self, slots: Slots, job_id: str) -> Iterator[Seat]:
        with slots.take() as slot:
            yield Seat(slot)


def no_process(device: str, exc: NoJobProcess) -> Ended:
    """The ending of a run that found no job process to run in."""
    logger.error("%s: %s", device, exc)
    return Ended.by_worker(type(exc), str(exc), pid=0, retired=None)
