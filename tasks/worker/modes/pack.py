"""A packed sweep's trial: it leads a pack (it takes more trials of its queue and trains them with
it in its job process) or joins the pack of the trial that took it (:mod:`tasks.worker.pack`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ...core.defaults import PACK_AUTO_MAX, PACK_JOIN_TIMEOUT_S
from ...core.errors import NoJobProcess
from ...core.wire import RunJob, RunPack
from .. import owners
from ..launch import Launch
from ..pack import Room, Rooms
from ..slots import Slots
from ..supervisor import Ended, Watch
from .base import RunMode, Seat, no_process
from .plain import Plain

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pack(RunMode):
    """A packed sweep's trial (:mod:`tasks.worker.pack`): a member taken by a leader joins its
    room (in its leader's slot, past the gate its leader passed, never preempted on its own:
    its leader's slot makes way as a whole); any other leads a pack of itself and the trials it
    takes from its queue."""

    plain: Plain
    rooms: Rooms

    def gated(self, job_id: str) -> bool:
        return self.rooms.room_of(job_id) is None

    @contextmanager
    def seat(self, slots: Slots, job_id: str) -> Iterator[Seat]:
        room = self.rooms.room_of(job_id)
        if room is not None:
            yield Seat(room.slot, preemptible=False, own=False)
            return
        with slots.take() as slot:
            yield Seat(slot)

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
            return no_process(self.plain.device, exc)
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
