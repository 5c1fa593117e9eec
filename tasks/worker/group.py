"""Device groups, owned by the workers: reservation, holds, wait-die, one job process.

``tasks.fan_out(job, "cpu", group=2)`` sends one message per group to its first device's queue,
carrying the group's :class:`~tasks.core.records.GroupSpec`. That device's worker, the
**leader** (:func:`run_group`), runs the whole group in the slot the message took:

0. as it sends the group, its **producer reserves** its devices
   (:func:`tasks.core.group_reservation.reserve_at_send`): an attempt id, ``sent`` (unclaimed),
   whose ``alive`` key lives :data:`~tasks.core.defaults.GROUP_CLAIM_TTL_S`. The keepers of the
   devices other than the leader's close their gates (step 2) at once; the leader's own device
   is left to its queue, first in, first out;
1. the leader, taking the message, **claims** that attempt if it is still alive and unclaimed,
   else **reserves** anew (:func:`tasks.core.group_reservation.reserve`): the attempt is in
   every device's claims (:mod:`tasks.core.claims`) at the group's precedence (its job's level,
   then its age), its ``alive`` key renewed to a lease's TTL and refreshed while it waits and
   runs. Where its own device runs nothing else and no claim before it is there, the same
   script holds it (step 2) and starts the group if the other devices already hold it;
2. each device's worker (:class:`GroupKeeper`, one thread per worker, the leader's own too)
   sees its device reserved and **closes its gate** (:class:`GroupGate`): no new single job of
   the group's level or lower starts there (one already taken waits, its message
   unacknowledged, in the slot it took); a running one finishes. Once the device runs nothing
   but the first group in precedence that reserved it, the keeper **holds** the device for that
   group (:func:`tasks.core.keys.group_hold`);
3. the leader starts once every device holds it (one script: the holds and the group's
   ``running`` state in one step, so a hold is never moved off a running group), and runs the
   job in one job process over all the devices' cores (:mod:`tasks.core.groups`): one of its
   own processes where the visibility is the same (a CPU group), else one started for the job
   with the group's ``CUDA_VISIBLE_DEVICES`` (a GPU group); ``ctx.devices`` names them; its
   memory budget is the sum of its devices' (:func:`~tasks.core.groups.group_budget`);
4. at its end it drops its reservations and holds; the keepers open their gates.

**Woken, not polled.** Whatever changes a device's claims nudges its keeper
(:func:`tasks.core.keys.group_nudge`, a list the keeper waits on with ``BLPOP``), as does a job
leaving a closed gate; a keeper that holds its device for a group wakes its leader
(:func:`tasks.core.keys.group_wake`). The polls remain as the fallback:
:data:`~tasks.core.defaults.GROUP_KEEPER_POLL_S` for an idle keeper (two round trips), which is
how a dead leader's reservation is dropped, and :data:`~tasks.core.defaults.GROUP_POLL_S` for a
waiting leader (which also looks at its job's cancel and time limit then).

**Not starved.** A reservation closes the gates of its devices at once, from the send on: a
stream of single jobs cannot keep a group's device busy for ever; the group waits for the jobs
running when it was sent (the longest of them), plus what its leader's queue held before it.

**Not in the way of higher work.** A single job of a higher level than every group that
reserved its device (the first in precedence is the highest) passes the closed gate: its
worker takes the device's hold back (:meth:`GroupKeeper.take_back`, under the gate's
:attr:`GroupGate.holds`, so no hold is set on what it has just decided) unless the group it is
held for runs, and the job runs. The group keeps its reservation and waits for that job's end,
as for a job that ran when it was sent; once the job leaves, the keeper holds the device for it
again. A group that has started is not preempted: the job waits for its end. Only higher
levels pass, so a stream of single jobs of the group's own level still cannot starve it.

**No deadlock.** Gangs and groups follow one give-way rule over one claim set
(:mod:`tasks.core.claims`, which says why it neither deadlocks nor starves).

**An unclaimed reservation.** A group cancelled before its leader took it lets its devices go at
once (its producer's cancel, :func:`tasks.core.group_reservation.release_unclaimed`); one whose
message never comes (its producer died before sending it) expires
:data:`~tasks.core.defaults.GROUP_CLAIM_TTL_S` after it was sent, and the keepers drop it.

**A dead leader.** Its job process dies with it (SIGKILL from the kernel); its ``alive`` key
expires a lease's TTL (``DEVICEFLEET_LEASE_TTL_S``) later and each keeper drops the
reservation and the hold: the devices take work again. The lease's reaper gives the job back, and
it runs again as a fresh attempt (a new attempt id, the same age).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from ..core import claims, group_reservation, keys
from ..core.defaults import GROUP_KEEPER_POLL_S, GROUP_POLL_S, GROUP_REFRESH_S
from ..core.errors import GiveWay, NoJobProcess
from ..core.groups import group_budget, group_cores, group_environment
from ..core.periodic import PeriodicThread
from ..core.placement import Constraints
from ..core.priority import DEFAULT_LEVEL, Level, precedence
from ..core.records import GroupSpec
from ..core.registry import read_worker
from ..core.replies import text
from ..core.wire import Outcome, RunJob
from .supervisor import Apart, Ended, Supervisor, Watch

logger = logging.getLogger(__name__)

class GroupGate:
    """Which jobs this worker runs now, and whether a group reserved its device (then no new
    single job starts, but one of a higher level than every group that reserved it). Local to
    the worker; :class:`GroupKeeper` closes and opens it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reserved = False
        #: The level of the first group in wait-die that reserved the device (the highest of
        #: them all: precedence ranks by level first); None while the gate is open.
        self._level: Level | None = None
        #: ``{job id: the group attempt it runs for, or None for a single job}``.
        self._running: dict[str, str | None] = {}
        #: Single jobs waiting at the closed gate now.
        self.held_back = 0
        #: Taken around "the device runs nothing else: hold it for a group" (the check and the
        #: hold's move in Redis) and around a single job of a higher level coming in and taking
        #: the hold back, so that neither acts on what the other has just changed.
        self.holds = threading.Lock()
        #: Called (outside the lock) when a job leaves while the gate is closed: the device may
        #: have fallen idle for the group that closed it (its keeper nudges itself).
        self.on_leave: Callable[[], None] = lambda: None
        #: Called (under :attr:`holds`) as a single job of a higher level comes in at the closed
        #: gate: let go of the device's hold unless the group it is held for runs (its keeper's
        #: :meth:`GroupKeeper.take_back`). Whether the device is free of any group's run.
        self.take_back: Callable[[], bool] = lambda: True

    @contextmanager
    def single(self, job_id: str, give_up: Callable[[], bool], level: Level = DEFAULT_LEVEL) -> Iterator[bool]:
        """Admit a single job of ``level`` once no group reserves the device, or at once if its
        level is higher than that of every group that reserved it (and none runs here); yields
        False instead when ``give_up()`` turned true while it waited (the worker stops: its
        message goes back)."""
        admitted = self._admit(job_id, give_up, level)
        if not admitted:
            yield False
            return
        try:
            yield True
        finally:
            self.leave(job_id)

    def _admit(self, job_id: str, give_up: Callable[[], bool], level: Level) -> bool:
        waiting = False
        ask_at = 0.0  # when a job that could not pass (a group ran on the device) asks again
        try:
            while True:
                with self._cond:
                    if not self._reserved:
                        self._running[job_id] = None
                        return True
                    overtakes = self._level is not None and level.rank < self._level.rank
                    if not overtakes or time.monotonic() < ask_at:
                        if not waiting:
                            self.held_back, waiting = self.held_back + 1, True
                        if give_up():
                            return False
                        self._cond.wait(GROUP_POLL_S)
                        continue
                if self._overtake(job_id):
                    return True
                # A group runs on the device: wait for it as any single job (its end opens the
                # gate); ask again after a keeper's poll, in case the hold moved meanwhile.
                ask_at = time.monotonic() + GROUP_KEEPER_POLL_S
        finally:
            if waiting:
                with self._cond:
                    self.held_back -= 1

    def _overtake(self, job_id: str) -> bool:
        """Run ``job_id`` before the groups that reserved the device (of a lower level): counted
        as running first, so that nothing holds the device for a group meanwhile, then the
        device's hold let go. False (and not counted) if a group's run holds the device."""
        with self.holds:
            with self._cond:
                self._running[job_id] = None
            try:
                free = self.take_back()
            except redis.RedisError as exc:  # looked at again after a poll
                logger.debug("could not let the device's hold go for job %s: %s", job_id, exc)
                free = False
            if not free:
                with self._cond:
                    self._running.pop(job_id, None)
            return free

    def lead(self, job_id: str, level: Level = DEFAULT_LEVEL) -> bool:
        """A group's job (its leader's) of ``level`` starts here, before it reserves: it never
        waits at the gate, and closes it (the group is about to reserve the device; the gate
        stays closed while a group's job is here). Whether nothing else runs on the device."""
        with self._cond:
            self._set_level(level if self._level is None else min(self._level, level, key=lambda lv: lv.rank))
            self._reserved = True
            idle = not self._running
            self._running[job_id] = ""
            return idle

    def enter_group(self, job_id: str, attempt: str) -> None:
        """The group's job ``job_id`` runs as ``attempt`` (once it has reserved)."""
        with self._cond:
            self._running[job_id] = attempt

    def leave(self, job_id: str) -> None:
        with self._cond:
            left = job_id in self._running
            self._running.pop(job_id, None)
            self._cond.notify_all()
            reserved = self._reserved
        if left and reserved:
            self.on_leave()

    def close(self, attempt: str, level: Level | None = None) -> bool:
        """Take no new single job, but of a level higher than ``level`` (the first group's in
        wait-die of those that reserved the device; None: as it was); whether the device runs
        nothing but ``attempt``'s job."""
        with self._cond:
            self._reserved = True
            if level is not None:
                self._set_level(level)
            return all(running == attempt for running in self._running.values())

    def _set_level(self, level: Level) -> None:
        if level is not self._level:
            self._level = level
            self._cond.notify_all()  # a waiting job of a higher level may come in now

    def open(self) -> None:
        """Take single jobs again, unless a group's job runs here (its reservation is on the way)."""
        with self._cond:
            if self._reserved and all(running is None for running in self._running.values()):
                self._reserved = False
                self._level = None
                self._cond.notify_all()

    @property
    def reserved(self) -> bool:
        return self._reserved


class GroupKeeper:
    """The thread that keeps one device's side of the groups that reserve it: drop dead
    reservations, close or open the gate, hold the device for the first group in precedence once
    idle. It looks when nudged, and every ``poll_s`` otherwise (the module's *Woken, not polled*)."""

    def __init__(self, client: redis.Redis, device: str, gate: GroupGate, poll_s: float = GROUP_KEEPER_POLL_S) -> None:
        self.client = client
        self.device = device
        self.gate = gate
        self.poll_s = poll_s
        self._nudge = keys.group_nudge(device)
        #: The group whose record says this device is closed to new single jobs, and how many
        #: it said wait at the gate.
        self._told: tuple[str, int] = ("", 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="devicefleet-groups", daemon=True)

    def start(self) -> None:
        self.gate.on_leave = self.nudge
        self.gate.take_back = self.take_back
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.gate.on_leave = lambda: None
        self.gate.take_back = lambda: True
        if self._thread.is_alive():
            self.nudge()  # out of its BLPOP now, rather than a poll later
            self._thread.join(self.poll_s + 1)

    def nudge(self) -> None:
        """Have the keeper look at its device now (from any thread of the worker)."""
        try:
            claims.nudge(self.client.pipeline(transaction=False), self.device).execute()
        except redis.RedisError as exc:  # it looks again within a poll
            logger.debug("%s: could not nudge its group keeper: %s", self.device, exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                if not self._stop.is_set():
                    self.client.blpop([self._nudge], timeout=self.poll_s)
            except redis.RedisError as exc:  # the gate stays as it was; looked at again next poll
                logger.debug("%s: could not look at its reservations: %s", self.device, exc)
                self._stop.wait(self.poll_s)
            except Exception:  # a malformed record in Redis: this thread must go on for every group
                logger.exception("%s: could not look at its reservations", self.device)
                self._stop.wait(self.poll_s)

    def take_back(self) -> bool:
        """Let go of the device's hold (a single job of a higher level than the groups that
        reserved the device comes in; its gate's :attr:`GroupGate.holds` is held), unless the
        group it is held for runs. Whether the device is free of any group's run. Its group
        keeps its reservation and waits: once the job has left, the device is held for it again.

        Raises:
            redis.RedisError: Redis did not answer; the job waits and asks again.
        """
        hold = keys.group_hold(self.device)
        for _ in range(3):  # the hold moved between the read and the move: read it again
            held = self.client.get(hold)
            if held is None:
                return True
            pipe = self.client.pipeline(transaction=False)
            group_reservation.move_hold(pipe, self.device, text(held), "")
            if pipe.execute()[-1]:
                logger.info("%s: hold for group %s let go for a single job of a higher level", self.device,
                            text(held))
                return True
            if self.client.get(hold) == held:  # its group runs
                return False
        return False

    def tick(self) -> None:
        """One look at the device's reservations and hold (the nudges so far are taken in)."""
        with self.gate.holds:
            self._tick()

    def _tick(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self._nudge)  # what changed before the reads below is seen by them
        pipe.zrange(keys.device_claims(self.device), 0, -1, withscores=True)
        pipe.get(keys.group_hold(self.device))
        _, entries, held = pipe.execute()
        held = text(held) if held is not None else ""
        # A sent group's claim on its leader's device closes no gate (its message is queued here).
        live = [c for c in claims.live(self.client, self.device, entries) if c.kind != claims.SENT]
        if not live or live[0].kind == claims.GANG:  # free, or a gang's rank must get in first
            if not held or self._move_hold(self.client.pipeline(transaction=False), held, ""):
                self._told = ("", 0)
                self.gate.open()
                return
            # The group it is held for runs here: it keeps the device, and the gate shut, to its end.
            live = [c for c in live if c.kind == claims.GROUP and c.id == held]
            if not live:
                return  # the hold moved meanwhile: looked at again at the next nudge or poll
        first = live[0].id  # the first group in precedence: of the highest level there
        idle = self.gate.close(first, live[0].level)
        told = (first, self.gate.held_back)
        pipe = self.client.pipeline(transaction=False)
        if self._told != told:  # the group's record says the device takes no new single job
            pipe.hset(keys.group_run(first), mapping={f"closed:{self.device}": self.gate.held_back})
            self._told = told
        if held != first and (idle or (held and held not in {c.id for c in live})):
            self._move_hold(pipe, held, first if idle else "")
        elif len(pipe):
            pipe.execute()

    def _move_hold(self, pipe: redis.client.Pipeline, held: str, to: str) -> bool:
        group_reservation.move_hold(pipe, self.device, held, to)
        moved = bool(pipe.execute()[-1])
        if moved and to:
            logger.info("%s: held for group %s", self.device, to)
        return moved


class GroupAlive(PeriodicThread):
    """Keeps a running group's leader ``alive`` key (and its hash) fresh while its job runs,
    from a thread of its own: the keepers drop a reservation whose key expired (a dead leader's).
    A refresh Redis refused is tried again at the next; a leader cut off for long is stopped by
    its lease's fencing."""

    name = "devicefleet-group-alive"

    def __init__(self, client: redis.Redis, attempt: str, ttl_ms: int) -> None:
        super().__init__(min(GROUP_REFRESH_S, ttl_ms / 4000))
        self.client = client
        self.attempt = attempt
        self.ttl_ms = ttl_ms

    def tick(self) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.group_alive(self.attempt), 1, px=self.ttl_ms)
            pipe.pexpire(keys.group_run(self.attempt), self.ttl_ms)
            pipe.execute()
        except redis.RedisError as exc:
            logger.debug("group %s: could not refresh its alive key: %s", self.attempt, exc)


class Reservation:
    """One attempt of a group's job, its leader's side in Redis."""

    def __init__(self, client: redis.Redis, spec: GroupSpec, job_id: str, ttl_ms: int, gate: GroupGate,
                 level: Level = DEFAULT_LEVEL) -> None:
        self.client = client
        self.ttl_ms = ttl_ms
        self.spec = spec
        #: Its job's level; with its age, its place in wait-die (lower goes first).
        self.level = level
        self.precedence = precedence(level, spec.seq)
        self.job_id = job_id
        self.gate = gate
        #: A fresh attempt's id, until :meth:`reserve` claims the one reserved at send time.
        self.attempt = f"{spec.id}.{uuid.uuid4().hex[:8]}"
        self.claimed = False
        self._holds = [keys.group_hold(d) for d in spec.devices]

    @property
    def key(self) -> str:
        return keys.group_run(self.attempt)

    def reserve(self) -> bool:
        """Claim the reservation its producer made as it sent the group, if it is still alive,
        else reserve every device anew (:func:`tasks.core.group_reservation.reserve`), holding
        the leader's own device if it runs nothing else. True if the group started at once."""
        with self.gate.holds:
            idle = self.gate.lead(self.job_id, self.level)
            self.claimed, started = group_reservation.reserve(
                self.client, group_id=self.spec.id, devices=self.spec.devices, seq=self.spec.seq,
                sent=self.spec.reservation, fresh=self.attempt, job_id=self.job_id, ttl_ms=self.ttl_ms,
                leader_idle=idle, level=self.level)
        if self.claimed:
            assert self.spec.reservation is not None
            self.attempt = self.spec.reservation
        self.gate.enter_group(self.job_id, self.attempt)
        return started

    def poll(self) -> bool:
        """Refresh the reservation; True once every device holds it (it is then running).

        The leader's own device is held here, by the leader's worker, as its keeper would (no
        reservation before it in precedence there, nothing but this group's job runs on it): one keeper fewer on
        the way to the start.

        Raises:
            GiveWay: a live claim of higher precedence (a gang's or a group's, of a higher level,
                or as high and older: :mod:`tasks.core.claims`) is on one of its devices, and this
                group has not started (a group that started never gives way).
        """
        devices = self.spec.devices
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.group_alive(self.attempt), 1, px=self.ttl_ms)
        pipe.pexpire(self.key, self.ttl_ms)
        for device in devices:
            claims.read_before(pipe, device, self.precedence)
        pipe.get(self._holds[0])
        group_reservation.start(pipe, self.attempt, devices)
        *found, own, started = pipe.execute()[2:]
        if started:
            return True
        if (first := claims.before(self.client, zip(devices, found, strict=True))) is not None:
            raise GiveWay(first[0], str(first[1]))
        own = text(own) if own is not None else ""
        with self.gate.holds:
            if own == self.attempt or found[0] or not self.gate.close(self.attempt):
                return False
            pipe = self.client.pipeline(transaction=False)
            group_reservation.move_hold(pipe, self.spec.leader, own, self.attempt)
            group_reservation.start(pipe, self.attempt, devices)
            return bool(pipe.execute()[-1])

    def wait(self, timeout_s: float) -> None:
        """Wait until a keeper holds a device for this attempt, at most ``timeout_s``."""
        self.client.blpop([keys.group_wake(self.attempt)], timeout=timeout_s)

    def note_waiting(self) -> None:
        """Say in the group's hash which devices it still waits for, and what they run."""
        holds = self.client.mget(self._holds)
        waiting: dict[str, str] = {}
        for device, held in zip(self.spec.devices, holds, strict=True):
            if held is not None and text(held) == self.attempt:
                continue
            record = read_worker(self.client, device)
            busy = record.busy if record is not None else None
            waiting[device] = ("no live worker" if record is None else
                               f"{busy.job} {busy.job_id} since {busy.since:.0f}" if busy is not None else
                               f"held for another group ({text(held)})" if held is not None else "its worker to hold it")
        self.client.hset(self.key, "waiting_for", json.dumps(waiting))

    def release(self) -> None:
        """Let every device go, and nudge their keepers: their gates open now."""
        pipe = self.client.pipeline(transaction=False)
        group_reservation.release(pipe, self.attempt, self.spec.devices)
        pipe.execute()


def refused_members(client: redis.Redis, spec: GroupSpec, leader: str, constraints: Constraints) -> str:
    """Why devices of group ``spec`` other than its ``leader`` do not meet ``constraints``
    (``cpu1: label rack is "b", not "a"``; ``""`` when each does): the producer placed the group
    where they held, but a member may have changed since (restarted with other labels); its
    leader checks its own device itself (:func:`tasks.worker.admission.device_mismatch`). A member with no
    live record is left to the group's wait, as without constraints. A question only: letting
    the group's devices go is :func:`let_go`'s."""
    whys = []
    for device in spec.devices:
        record = read_worker(client, device) if device != leader else None
        why = constraints.why_not(record) if record is not None else ""
        if why:
            whys.append(f"{device}: {why}")
    return "; ".join(whys)


def let_go(client: redis.Redis, spec: GroupSpec) -> None:
    """The devices reserved for group ``spec`` at send time are let go: it will not run."""
    if spec.reservation is not None:
        group_reservation.release_unclaimed(client, spec.devices, spec.reservation)


def run_group(client: redis.Redis | None, spec: GroupSpec, device: str, gate: GroupGate,
              supervisor: Supervisor, lease_ttl_s: float, job: RunJob, watch: Watch,
              run: Callable[[RunJob, Watch, int | None, Apart | None], Ended],
              on_start: Callable[[], None] = lambda: None, level: Level = DEFAULT_LEVEL) -> Ended:
    """Run ``job`` as the group ``spec`` led by ``device``: reserve, wait for every device's
    hold, run it in one job process over them all (``run(job, watch, budget_bytes, apart)``:
    within the sum of its devices' memory budgets, :func:`~tasks.core.groups.group_budget`; in
    a process of its own where its visibility is not the device's), release.
    Its reservation lives as long as a lease (``lease_ttl_s``) past its leader's last refresh. Never raises: the :class:`Ended`
    says how it ended, ``give_way`` when a group before it in precedence needs one of its devices. ``on_start``
    is called once every device holds it, as its job starts (its entry's ``started_at``).
    ``level``: its job's, its precedence in wait-die before its age."""
    if client is None:
        return Ended.by_worker(NoJobProcess, f"{device} is not joined to a fleet: a device group needs its Redis",
                               pid=0, retired=None)
    if device != spec.leader:
        return Ended.by_worker(NoJobProcess, f"{device} took the message of group {spec.name}, which its "
                               f"leader {spec.leader} runs: send groups with fan_out(..., group=k)", pid=0, retired=None)
    ttl_ms = int(lease_ttl_s * 1000)
    reservation = Reservation(client, spec, job.job_id, ttl_ms, gate, level)
    try:
        started_at_once = reservation.reserve()
        logger.info("%s: group %s (%s) %s %s; waiting for its devices", device, spec.name, reservation.attempt,
                    "claimed its reservation of" if reservation.claimed else "reserved", ", ".join(spec.devices))
        started = time.monotonic()
        noted = 0.0
        while not started_at_once and not reservation.poll():
            stop = watch.stop()
            if stop is not None and (stop := watch.act_on(stop)) is not None:
                return Ended.stopped(stop, f"{stop.message} (while group {spec.name} waited for its devices)")
            if time.monotonic() - noted > GROUP_REFRESH_S:
                noted = time.monotonic()
                reservation.note_waiting()
            reservation.wait(GROUP_POLL_S)
        logger.info("%s: group %s starts after %.2f s", device, spec.name, time.monotonic() - started)
        on_start()
        records = [read_worker(client, d) for d in spec.devices]
        cores = group_cores([r for r in records if r is not None]) or list(supervisor.spec.cores)
        budget = group_budget(records)
        env = group_environment(spec.devices)
        job = job.model_copy(update={"devices": list(spec.devices), "cores": cores, "torch_threads": len(cores)})
        alive = GroupAlive(client, reservation.attempt, ttl_ms)
        alive.start()
        try:
            return run(job, watch, budget, Apart(env, budget) if supervisor.needs_own_process(env) else None)
        finally:
            alive.stop(timeout=0)  # a refresh in flight finishes on its own
    except GiveWay as exc:
        logger.info("%s: group %s gives way: %s", device, spec.name, exc)
        return Ended(outcome=Outcome.GIVE_WAY, finished=None, error=None, error_module=None, pid=0, retired=None)
    except NoJobProcess as exc:
        return Ended.by_worker(NoJobProcess, str(exc), pid=0, retired=None)
    finally:
        gate.leave(job.job_id)
        try:
            reservation.release()
        except redis.RedisError as exc:  # its alive key expires: the keepers drop it then
            logger.warning("%s: could not release group %s: %s", device, spec.name, exc)
