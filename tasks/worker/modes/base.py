"""What a run mode is (:class:`RunMode`): the hooks the runner asks of every job, never which
mode it runs in."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

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


class RunMode:
    """A way to run a job, with the hooks the runner asks of every job; each hook here is what
    a mode that says nothing of its own does: no check beyond its device's, it waits at the
    gate, it takes a slot of its own and may be preempted."""

    #: Whether its job runs on this device alone: the black-hole rule judges only such a job's
    #: fast failures (:mod:`tasks.worker.blackhole`).
    alone: ClassVar[bool] = False

    def admit(self, options: JobOptions, mismatch: DeviceMismatch | None) -> DeviceMismatch | None:
        """The mode's own checks of a job with constraints, once this device's were checked
        (``mismatch``: they failed): the refusal its end is stored with; None: it may run."""
        return mismatch

    def gated(self, job_id: str) -> bool:
        """Whether the job waits at the gate a device group closes (:class:`tasks.worker.group.GroupGate`)."""
        return True

    @contextmanager
    def seat(self, slots: Slots, job_id: str) -> Iterator[Seat]:
        """Hold the job's seat for its run."""
        with slots.take() as slot:
            yield Seat(slot)

    def run(self, launch: Launch) -> Ended:
        """Run ``launch``'s job to its end: how it ended, never raised for the job's sake."""
        raise NotImplementedError


def no_process(device: str, exc: NoJobProcess) -> Ended:
    """The ending of a run that found no job process to run in."""
    logger.error("%s: %s", device, exc)
    return Ended.by_worker(type(exc), str(exc), pid=0, retired=None)
