"""A device group's job, led by this worker (:func:`tasks.worker.group.run_group`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from ...core.errors import DeviceMismatch
from ...core.records import JobOptions
from .. import group
from ..group import GroupGate
from ..launch import Launch
from ..slots import Slots
from ..supervisor import Ended
from .base import RunMode, Seat
from .plain import Plain


@dataclass(frozen=True)
class Group(RunMode):
    """A device group's job: its leader reserves and holds the group's devices (it waits at no
    gate), then runs it in one job process over them all; it stops only as a whole (never
    preempted)."""

    plain: Plain
    client: redis.Redis | None
    device: str
    gate: GroupGate
    #: The group's reservation lives this long past its leader's last refresh.
    lease_ttl_s: float

    def admit(self, options: JobOptions, mismatch: DeviceMismatch | None) -> DeviceMismatch | None:
        return mismatch or self._mismatch(options)

    def _mismatch(self, options: JobOptions) -> DeviceMismatch | None:
        """None when each device of the job's group meets its constraints
        (:func:`tasks.worker.group.refused_members`); else the group's devices are let go."""
        spec, constraints = options.group, options.constraints
        if spec is None or constraints is None or self.client is None:
            return None
        why = group.refused_members(self.client, spec, self.device, constraints)
        if not why:
            return None
        group.let_go(self.client, spec)
        return DeviceMismatch(f"group {spec.name}: not every device meets the job's constraints "
                              f"{constraints.describe()}: {why}; it did not run")

    def gated(self, job_id: str) -> bool:
        return False

    @contextmanager
    def seat(self, slots: Slots, job_id: str) -> Iterator[Seat]:
        with slots.take() as slot:
            yield Seat(slot, preemptible=False)

    def run(self, launch: Launch) -> Ended:
        spec = launch.options.group
        assert spec is not None, "a group's run needs the job's group"
        slot = launch.slot
        return group.run_group(
            self.client, spec, self.device, self.gate, self.plain.supervisor, self.lease_ttl_s, launch.message,
            launch.watch, lambda job, watch, budget, apart: self.plain.in_process(
                job, watch, dataclasses.replace(slot, budget_bytes=budget), apart),
            on_start=launch.on_start, level=launch.options.priority)
