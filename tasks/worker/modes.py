"""How a job runs on its worker: one shape for every run mode, chosen by the job's options.

A run mode takes one :class:`Launch` (the job's message and options, its watch, the slot it
took, its lease's token, its start clock) and returns the run's
:class:`~tasks.worker.supervisor.Ended`: how it ended, with the stop its worker sent it. It
never raises for a job's own ending; the runner matches on the outcome
(:func:`tasks.worker.runner.settle`). The modes are built once per worker with its services
bound (:class:`RunModes`, the device worker's ``modes``):

- :class:`Plain`: the job in one of the worker's job processes, in its slot;
- :class:`Gang`: a rank of a distributed job (:mod:`tasks.worker.gang` joins, assembles, runs
  it again with its gang);
- :class:`Group`: a device group's job, led by this worker (:mod:`tasks.worker.group` reserves
  and holds its devices, then runs it in one job process over them all);
- :class:`Pack`: a packed sweep's trial: it leads a pack (it takes more trials of its queue and
  trains them with it in its job process) or joins the pack of the trial that took it
  (:mod:`tasks.worker.pack`).

A new mode is one more class here with a ``run(launch) -> Ended`` and one more line in
:meth:`RunModes.of`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import redis

from ..core.defaults import PACK_AUTO_MAX, PACK_JOIN_TIMEOUT_S
from ..core.errors import NoJobProcess
from ..core.records import GangSpec, JobOptions
from ..core.wire import RunJob, RunPack
from . import gang, group, owners
from .group import GroupGate
from .launch import Launch
from .pack import Room, Rooms
from .slots import Slot
from .supervisor import Apart, Ended, Supervisor, Watch

logger = logging.getLogger(__name__)


class RunMode(Protocol):
    """A way to run a job: it returns how the run ended and never raises for the job's sake."""

    def run(self, launch: Launch) -> Ended:
        """Run ``launch``'s job to its end."""


@dataclass(frozen=True)
class Plain:
    """A job in one of the worker's job processes, in the slot it took."""

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
            logger.error("%s: %s", self.device, exc)
            return Ended.by_worker(type(exc), str(exc), pid=0, retired=None)


@dataclass(frozen=True)
class Gang:
    """A rank of a distributed job (:func:`tasks.worker.gang.run_rank`)."""

    plain: Plain
    client: redis.Redis
    device: str
    #: Where the gang's other ranks reach this worker (rank 0's store).
    address: str
    #: How long the gang's hash lives.
    expires_s: int
    #: A rank's grace when its gang is preempted.
    preempt_grace_s: float

    def run(self, launch: Launch) -> Ended:
        spec = launch.options.gang
        assert spec is not None, "a gang's run needs the job's gang"
        return gang.run_rank(self.client, spec, self.device, self.address, self.expires_s, launch.message,
                             launch.watch, lambda rank, watch: self.plain.in_process(rank, watch, launch.slot),
                             token=launch.token, level=launch.options.priority,
                             preempt_grace_s=self.preempt_grace_s)

    def refuse(self, spec: GangSpec, why: str) -> None:
        """This worker will not run its rank of ``spec`` (:func:`tasks.worker.gang.refuse_rank`)."""
        try:
            gang.refuse_rank(self.client, spec, self.device, why, self.expires_s)
        except redis.RedisError as exc:  # its peers end at their join timeout instead
            logger.warning("%s: could not fail gang %s for its refused rank: %s", self.device, spec.id, exc)


@dataclass(frozen=True)
class Group:
    """A device group's job, led by this worker (:func:`tasks.worker.group.run_group`)."""

    plain: Plain
    client: redis.Redis | None
    device: str
    gate: GroupGate
    #: The group's reservation lives this long past its leader's last refresh.
    lease_ttl_s: float

    def run(self, launch: Launch) -> Ended:
        spec = launch.options.group
        assert spec is not None, "a group's run needs the job's group"
        slot = launch.slot
        return group.run_group(
            self.client, spec, self.device, self.gate, self.plain.supervisor, self.lease_ttl_s, launch.message,
            launch.watch, lambda job, watch, budget, apart: self.plain.in_process(
                job, watch, dataclasses.replace(slot, budget_bytes=budget), apart),
            on_start=launch.on_start, level=launch.options.priority)


@dataclass(frozen=True)
class Pack:
    """A packed sweep's trial (:mod:`tasks.worker.pack`): a member taken by a leader joins its
    room; any other leads a pack of itself and the trials it takes from its queue."""

    plain: Plain
    rooms: Rooms

    def run(self, launch: Launch) -> Ended:
        job_id = launch.message.job_id
        room = self.rooms.room_of(job_id)
        if room is not None:
            return room.join(launch)
        size = launch.options.pack
        wanted = (PACK_AUTO_MAX if size == "auto" else int(size or 1)) - 1
        room = Room(launch)
        try:
            taken = launch.siblings(room, wanted) if launch.siblings is not None and wanted > 0 else 0
            members = room.wait_joined(PACK_JOIN_TIMEOUT_S) if taken else []
            members = _one_users(launch, room, members)
            if not members:
                return self.plain.run(launch)
            return self._lead(launch, room, members)
        finally:
            room.close("its pack ended before it ran")

    def _lead(self, launch: Launch, room: Room, members: list[Launch]) -> Ended:
        job_id = launch.message.job_id
        pack = RunPack(members=[launch.message, *(member.message for member in members)])
        watches = {job_id: launch.watch, **{member.message.job_id: member.watch for member in members}}
        mine: list[Ended] = []

        def on_end(member: str, ended: Ended) -> None:
            if member == job_id:
                mine.append(ended)
            else:
                room.deliver(member, ended)

        known = set(watches)

        def refill() -> tuple[RunJob, Watch] | None:
            """The next waiting trial of the pack's queue, taken and joined as the first were."""
            while launch.siblings is not None and launch.siblings(room, 1) > 0:
                joined = [m for m in room.wait_joined(PACK_JOIN_TIMEOUT_S) if m.message.job_id not in known]
                known.update(m.message.job_id for m in joined)
                if not joined:  # its lease was refused or it was cancelled: take the next
                    continue
                joined = _one_users(launch, room, joined)
                if not joined:  # another user's (back to its queue, alone): take no more, or it comes again
                    return None
                logger.info("%s: job %s takes a freed place in job %s's pack", self.plain.device,
                            joined[0].message.job_id, job_id)
                return joined[0].message, joined[0].watch
            return None

        logger.info("%s: job %s leads a pack of %d trials", self.plain.device, job_id, len(pack.members))
        try:
            self.plain.supervisor.run_pack(pack, watches, launch.slot, on_end, refill)
        except NoJobProcess as exc:
            logger.error("%s: %s", self.plain.device, exc)
            return Ended.by_worker(type(exc), str(exc), pid=0, retired=None)
        assert mine, "run_pack ends every member"
        return mine[0]


def _one_users(leader: Launch, room: Room, members: list[Launch]) -> list[Launch]:
    """The ``members`` of the leader's user: one job process runs one user's jobs
    (:mod:`tasks.worker.owners`), so another's trial (its queue shared by two users' sweeps) goes
    back to run alone."""
    owner = owners.owner_of(leader.message)
    mine = []
    for member in members:
        if owners.owner_of(member.message) == owner:
            mine.append(member)
        else:
            room.unpack(member.message.job_id, f"its user is not its pack leader's ({owner or 'local'})")
    return mine


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
