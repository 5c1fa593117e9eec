"""How a job runs on its worker: one shape for every run mode, chosen by the job's options.

A run mode (:class:`~tasks.worker.modes.base.RunMode`) has the hooks the runner asks of every
job (:func:`tasks.worker.runner.execute`), so the runner never asks which mode a job runs in:
its own checks before it runs (``admit``), whether it waits at a device group's gate
(``gated``), where it sits (``seat``), whether the black-hole rule judges its failures
(``alone``), and its run: it takes one :class:`~tasks.worker.launch.Launch` (the job's message
and options, its watch, the slot it took, its lease's token, its start clock) and returns the
run's :class:`~tasks.worker.supervisor.Ended`. It never raises for a job's own ending: the
ending becomes a disposition (:func:`tasks.worker.disposition.settle`). The modes are built once
per worker with its services bound (:class:`RunModes`, the device worker's ``modes``):

- :class:`Plain` (:mod:`.plain`): the job in one of the worker's job processes, in its slot;
- :class:`Gang` (:mod:`.gang`): a rank of a distributed job (:mod:`tasks.worker.gang` joins,
  assembles, runs it again with its gang);
- :class:`Group` (:mod:`.group`): a device group's job, led by this worker
  (:mod:`tasks.worker.group` reserves and holds its devices, then runs it in one job process
  over them all);
- :class:`Pack` (:mod:`.pack`): a packed sweep's trial: it leads a pack or joins the pack of the
  trial that took it (:mod:`tasks.worker.pack`).

A new mode is one more module here, with the hooks it changes, and one more line in
:meth:`RunModes.of`.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from ...core.records import JobOptions
from ..group import GroupGate
from ..pack import Rooms
from ..supervisor import Supervisor
from .base import Mode, RunMode, Seat
from .gang import Gang
from .group import Group
from .pack import Pack
from .plain import Plain

__all__ = ["Gang", "Group", "Mode", "Pack", "Plain", "RunMode", "RunModes", "Seat"]


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
