"""How a job runs on its worker: one module per run mode, chosen by the job's options.

A run mode (:class:`~tasks.worker.modes.base.RunMode`) has the hooks the runner asks of every
job (:func:`tasks.worker.runner.execute`), so the runner never asks which mode a job runs in.
The modes are built once per worker with its services bound (:class:`RunModes`, the device
worker's ``modes``): :class:`Plain` (a job process in its slot), :class:`Gang` (a distributed
job's rank), :class:`Group` (a device group's job, led here), :class:`Pack` (a packed sweep's
trial, leading a pack or joining one). A new mode is one more module here, with the hooks it
changes, and one more line in :meth:`RunModes.of`.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from ...core.records import JobOptions
from ..group import GroupGate
from ..pack import Rooms
from ..supervisor import Supervisor
from .base import RunMode, Seat
from .gang import Gang
from .group import Group
from .pack import Pack
from .plain import Plain

__all__ = ["Gang", "Group", "Pack", "Plain", "RunMode", "RunModes", "Seat"]


@dataclass(frozen=True)
class RunModes:
    """The worker's run modes, built once with its services bound."""

    plain: Plain
    gang: Gang
    group: Group
    pack: Pack

    @classmethod
    def build(cls, supervisor: Supervisor, client: redis.Redis, device: str, gate: GroupGate, address: str,
              expires_s: int, lease_ttl_s: float, preempt_grace_s: float) -> RunModes:
        plain = Plain(supervisor, device)
        return cls(plain=plain,
                   gang=Gang(plain, client, device, address, expires_s, preempt_grace_s),
                   group=Group(plain, client, device, gate, lease_ttl_s),
                   pack=Pack(plain, Rooms()))

    def of(self, options: JobOptions) -> RunMode:
        """The mode a job with ``options`` runs in."""
        if options.group is not None:
            return self.group
        if options.gang is not None:
            return self.gang
        if options.pack is not None:
            return self.pack
        return self.plain
