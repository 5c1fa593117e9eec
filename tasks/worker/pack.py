"""Packed trials on the worker: a leader, the siblings it takes from its queue, one job process.

A sweep sent with ``pack=K`` (:func:`tasks.sweep`) puts its trials on its own queue, each an
ordinary trial message (its own id, lease, fencing token and entry) whose options say ``pack``.
The worker that takes one of them (the *leader*, in its slot) takes up to ``K - 1`` more waiting
messages of the same queue and level (:mod:`tasks.worker.siblings`), each run in a thread of its
own through the runner's one path (its own lease, watch and stored end). Those threads meet the
leader in a :class:`Room`; the leader's job process trains them all at once as one
:class:`~tasks.core.wire.RunPack` (:meth:`tasks.worker.supervisor.Supervisor.run_pack`), and each
member's :class:`~tasks.worker.supervisor.Ended` goes back to its own thread as soon as the job
process ends it. A member the pack could not finish ends as
:data:`~tasks.core.wire.Outcome.UNPACK`: its message goes back to its queue, to run alone. A place
a member frees is refilled with the next waiting trial (``Pack._lead``'s refill,
:mod:`tasks.worker.modes.pack`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import JobCrashed
from ..core.wire import Outcome
from .launch import Launch
from .supervisor import Ended

logger = logging.getLogger(__name__)


@dataclass
class _Seat:
    """One member's place in a room: its launch once it joined, its ending once it has one."""

    launch: Launch | None = None
    ended: Ended | None = None
    #: Set when the member's thread will not join (its lease was refused, it was cancelled or
    #: its options were bad): the leader stops waiting for it.
    gone: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Room:
    """Where the members of one pack meet its leader.

    The leader opens it, names the members it took (:meth:`expect`), waits for them to join or
    drop out (:meth:`wait_joined`), runs the pack and hands each member its ending
    (:meth:`deliver`); :meth:`close` ends any member still waiting, so no thread is left behind.
    """

    def __init__(self, leader: Launch) -> None:
        self.leader = leader
        self._cond = threading.Condition()
        self._seats: dict[str, _Seat] = {}
        self._closed = False

    @property
    def slot(self) -> Any:
        return self.leader.slot

    def expect(self, job_id: str) -> None:
        with self._cond:
            self._seats[job_id] = _Seat()

    def join(self, launch: Launch) -> Ended:
        """A member's thread: wait in the room until the pack ends it; returns its ending."""
        job_id = launch.message.job_id
        with self._cond:
            seat = self._seats[job_id]
            if self._closed:
                seat.ended = seat.ended or _unpacked(job_id, "its pack had already ended")
            else:
                seat.launch = launch
            self._cond.notify_all()
        seat.done.wait()  # set by deliver() or close(): never left waiting
        assert seat.ended is not None
        return seat.ended

    def left(self, job_id: str) -> None:
        """A member's thread ended without joining (its lease, its options, a cancel)."""
        with self._cond:
            seat = self._seats.get(job_id)
            if seat is not None and seat.launch is None:
                seat.gone = True
                seat.done.set()
                self._cond.notify_all()

    def wait_joined(self, timeout_s: float) -> list[Launch]:
        """The members that joined, once every expected one joined or left (at most
        ``timeout_s``; a member that is still on its way then runs unpacked)."""
        with self._cond:
            self._cond.wait_for(lambda: all(s.launch is not None or s.gone for s in self._seats.values()),
                                timeout=timeout_s)
            return [s.launch for s in self._seats.values() if s.launch is not None]

    def deliver(self, job_id: str, ended: Ended) -> None:
        """End member ``job_id`` with ``ended`` (its thread goes on to settle it at once)."""
        with self._cond:
            seat = self._seats.get(job_id)
            if seat is None or seat.done.is_set():
                return
            seat.ended = ended
            seat.done.set()

    def unpack(self, job_id: str, why: str) -> None:
        """End member ``job_id`` as :data:`Outcome.UNPACK` (``why``): back to its queue, alone."""
        self.deliver(job_id, _unpacked(job_id, why))

    def close(self, why: str) -> None:
        """End every member that has no ending yet as :data:`Outcome.UNPACK` (``why``)."""
        with self._cond:
            self._closed = True
            for job_id, seat in self._seats.items():
                if not seat.done.is_set():
                    seat.ended = _unpacked(job_id, why)
                    seat.done.set()


def _unpacked(job_id: str, why: str) -> Ended:
    return Ended.by_worker(JobCrashed, f"pack member {job_id}: {why}; it goes back to its queue to run alone",
                           pid=0, retired=None, outcome=Outcome.UNPACK)


class Rooms:
    """The packs running on one worker: which member waits in which room."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._member_of: dict[str, Room] = {}

    def seat(self, room: Room, job_id: str) -> None:
        with self._lock:
            room.expect(job_id)
            self._member_of[job_id] = room

    def room_of(self, job_id: str) -> Room | None:
        """The room member ``job_id`` joins; None: it is not a pulled member (it may lead)."""
        with self._lock:
            return self._member_of.get(job_id)

    def leave(self, job_id: str) -> None:
        """Member ``job_id``'s thread is done with its room."""
        with self._lock:
            room = self._member_of.pop(job_id, None)
        if room is not None:
            room.left(job_id)

