"""Distributed jobs' gangs, owned by the worker: membership, generations, wait-die, restarts.

``tasks.fan_out(job, devices, distributed=True)`` sends one message per device, each carrying
the gang's :class:`~tasks.core.records.GangSpec` in its options; rank ``i`` is the job on
``devices[i]``. The worker that takes a rank (:func:`run_rank`), as torchrun's elastic agent
does for its workers, and never in the job process (which holds no key to Redis):

1. joins the gang's rendezvous, one Redis hash (:func:`tasks.core.keys.gang`), in the current
   generation, and waits until every rank has joined it. A rank that waits longer than
   ``join_timeout_s`` fails the gang with a message naming the devices that did not come;
2. hands the job to a job process with its :class:`~tasks.core.wire.Rank` (rank, world size,
   generation, rank 0's address): rank 0's job process opens the gang's ``TCPStore`` and says
   on which port (:class:`~tasks.core.wire.StoreOpened`), which this worker publishes in the
   gang's hash; the other ranks' workers wait for it before they start their job. The job
   process runs ``init_process_group`` and the job (:mod:`tasks.jobproc.rank`);
3. watches the gang while the rank runs (:class:`GangWatch`): a gang that failed or moved to
   another generation stops the rank (``StopReason.GANG``), and a peer the fleet says is lost
   moves the gang on first.

**Restarts.** One loop for ``@job`` ranks and command ranks. A rank whose job process crashed,
or whose collective lost a peer (the outcome ``peer_lost``, :func:`tasks.jobproc.rank.peer_lost`)
runs again, in a fresh job process where it crashed: it moves the gang to the next generation
and waits there; its peers follow. A rank whose whole worker died runs again on its device (the
lease's reaper gives its message back, :mod:`tasks.worker.reaper`): its fresh run finds the
generation it had joined complete and moves the gang on too; all meet in the next generation
and the job resumes from its checkpoint (``train`` saves one). After ``max_restarts``
generations the gang fails (the restart budget is the join script's). Any other error of a
rank's job fails the gang at once (before the rank's group goes: :class:`~tasks.core.wire.RankFailed`),
and the peers fail naming it.

**Preempted as a whole.** A rank's worker that finds higher-level work waiting for its device
(:mod:`tasks.worker.preemption`) does not stop its rank alone (its peers would hang in their
next collective): its :class:`GangWatch` first marks the gang's generation preempted in the
gang's hash (:meth:`~tasks.core.rendezvous.Rendezvous.preempt`), and every rank's watch, its own included, reads the
mark at its next look (:data:`~tasks.core.defaults.GANG_WATCH_INTERVAL_S`) and stops its rank
with the preemption's grace. Each rank goes back to the front of its queue (a preemption, not a
failure: no death, no restart counted) and the gang assembles again in its next generation once
every device has taken its rank back; the generation a preemption ended is not counted against
``max_restarts``. A rank whose collective failed because a peer stopped first finds the mark
too (it is written before any rank stops).

**No deadlock.** The producer sends each gang's ranks under one lock (``keys.GANG_SEND_LOCK``),
so every device's queue holds one gang's ranks before the next's; where that order breaks (the
reaper gives a dead worker's rank back at the front of its queue), and between a gang and a
device group, the one give-way rule of :mod:`tasks.core.claims` orders them.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import redis

from ..core.defaults import GANG_WATCH_INTERVAL_S as WATCH_INTERVAL_S
from ..core.defaults import PREEMPT_GRACE_S
from ..core.devices import host_name
from ..core.errors import GangFailed, GiveWay, PeerLost
from ..core.jobstate import JobState
from ..core.priority import DEFAULT_LEVEL, Level
from ..core.records import GangSpec
from ..core.rendezvous import Rendezvous
from ..core.sentinel import first_host, is_sentinel
from ..core.wire import ModeMessage, Outcome, Proceed, Rank, RankFailed, RunJob, StopJob, StopReason, StoreOpened
from .supervisor import Ended, Watch, WatchOver

logger = logging.getLogger(__name__)


def _preempted(rdv: Rendezvous, gen: int, job_id: str, watch: GangWatch) -> StopJob | None:
    """The stop of a rank whose generation ``gen`` of the gang was preempted (the mark is
    written before any rank stops), which it makes way with; None if it was not, or where Redis
    cannot say."""
    try:
        _, _, mark = rdv.look()
    except redis.RedisError:
        return None
    if mark is None or mark[0] != gen:
        return None
    watch.made_way(mark[1])
    return StopJob(job_id=job_id, reason=StopReason.PREEMPT, level=mark[1],
                   message=f"{rdv.spec.id} ({rdv.device}, rank {rdv.rank}) made way as a whole for "
                           f"{mark[1].value} work; it goes back to its queues and runs again")


def route_address(redis_url: str) -> str:
    """This host's address on its route to Redis: what the other hosts of the fleet can reach
    (``127.0.0.1`` when Redis is on loopback). Sends nothing (a UDP socket's ``connect``)."""
    host = (first_host(redis_url) if is_sentinel(redis_url) else urlsplit(redis_url).hostname) or "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, 6379, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        if family == socket.AF_INET and str(sockaddr[0]).startswith("127."):
            return "127.0.0.1"
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        logger.warning("could not find this host's address towards %s (%s); distributed jobs "
                       "will advertise 127.0.0.1: set DEVICEFLEET_ADVERTISE_ADDRESS", host, exc)
        return "127.0.0.1"


class GangWatch(WatchOver):
    """The watch of one rank's run in one generation: the job's own watch (progress, stops), and
    the gang's side of it: rank 0's store published, a rank's own failure failing the gang, a
    gang that failed or moved on stopping the rank, and a lost peer moving the gang on.

    A peer is lost when the fleet says so (:meth:`~tasks.core.rendezvous.Rendezvous.lost_peer`): its lease is gone (its
    worker cut off from Redis, which stops the rank itself, or dead) or a newer attempt holds its
    job. Its collective would wait out ``collective_timeout_s`` for a peer that cannot answer (a
    cut-off host drops every packet: nothing resets the connection), so the watch moves the gang
    to its next generation itself (:meth:`~tasks.core.rendezvous.Rendezvous.move_on`: a restart, or the gang fails once
    its restarts are spent) within the lease TTL and :data:`~tasks.core.defaults.GANG_WATCH_INTERVAL_S` of the peer's last
    renewal, and the rank is stopped as for a gang that moved on.

    The gang is read from a thread of its own, every :data:`~tasks.core.defaults.GANG_WATCH_INTERVAL_S`: the supervisor's
    loop, which asks :meth:`stop`, never waits on Redis (a cut-off worker's reads hang for as long
    as its TCP retries last, and its own job's self-fencing must not wait for them). :meth:`close`
    ends it. A preemption its own worker asks for is held back until this thread has marked the
    gang preempted (the module's *Preempted as a whole*)."""

    def __init__(self, inner: Watch, rdv: Rendezvous, job_id: str, generation: int, address: str,
                 jobs: JobState | None = None, preempt_grace_s: float = PREEMPT_GRACE_S) -> None:
        super().__init__(inner)
        self.rdv = rdv
        self.preempt_grace_s = preempt_grace_s
        #: The preemption this rank's worker asked for (held back until the gang is marked).
        self._asked: StopJob | None = None
        self.job_id = job_id
        self.generation = generation
        self.address = address
        self._jobs = jobs or JobState(rdv.client)
        self._peers: dict[int, tuple[str, int]] | None = None
        self._verdict: StopJob | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"devicefleet-gang-{rdv.rank}", daemon=True)
        self._thread.start()

    def heard(self, message: ModeMessage) -> Proceed | None:
        """A rank's messages: rank 0's store port is published to the gang; a rank's own error
        fails the gang now, and the rank is told to proceed (to take its process group down)."""
        match message:
            case StoreOpened(port=port):
                try:
                    self.rdv.publish_store(self.generation, self.address, port)
                except redis.RedisError as exc:  # the other ranks do not find it: they fail the gang, naming rank 0
                    logger.warning("%s: could not publish %s's store: %s", self.rdv.device, self.rdv.spec.id, exc)
                return None
            case RankFailed(reason=reason):
                try:
                    self.rdv.fail(reason)
                except redis.RedisError as exc:  # failed again once the job process says it ended
                    logger.warning("%s: could not fail %s: %s", self.rdv.device, self.rdv.spec.id, exc)
                return Proceed()

    def stop(self) -> StopJob | None:
        stop = self.inner.stop()
        if stop is not None and stop.reason is StopReason.PREEMPT and self._verdict is not None:
            return self._verdict  # the gang's own stop ends this run anyway: nothing to claim for it
        return stop or self._verdict

    def act_on(self, stop: StopJob) -> StopJob | None:
        if stop is self._verdict:  # the gang's own stop: its worker has nothing to take for it
            return stop
        acted = self.inner.act_on(stop)
        if acted is not None and acted.reason is StopReason.PREEMPT:
            # Its worker asked it to make way: the whole gang is told first (_watch marks it,
            # and the mark stops every rank), this rank with it.
            self._asked = acted
            return None
        return acted

    def made_way(self, level: Level) -> None:
        """The gang makes way for ``level`` work as a whole, though this rank's worker may not
        have asked it (the stop that follows says so too)."""
        logger.info("job %s on %s: its gang makes way for %s work as a whole", self.job_id, self.rdv.device,
                    level.value)

    def close(self) -> None:
        """The run ended: stop watching (a read in flight is left to finish on its own)."""
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            try:
                if self._asked is not None:
                    self._mark()
                verdict = self.look()
            except redis.RedisError as exc:  # looked at again in WATCH_INTERVAL_S; its collectives tell meanwhile
                logger.debug("%s: could not look at %s: %s", self.rdv.device, self.rdv.spec.id, exc)
                continue
            except Exception:  # a malformed record in Redis: the watch goes on (a lost peer must still be seen)
                logger.exception("%s: could not look at %s", self.rdv.device, self.rdv.spec.id)
                continue
            if verdict is not None:
                self._verdict = verdict
                return

    def _mark(self) -> None:
        """This rank's worker asked it to make way: mark the gang (``look`` then stops every
        rank); a gang that failed or moved on meanwhile is stopped by ``look`` for that."""
        level = (self._asked.level if self._asked is not None else None) or Level.URGENT
        if self.rdv.preempt(self.generation, level):
            logger.info("%s: rank %d of %s makes way for %s work: the whole gang stops", self.rdv.device,
                        self.rdv.rank, self.rdv.spec.id, level.value)

    def look(self) -> StopJob | None:
        """Look at the gang once: the stop its state calls for, or ``None``.

        Raises:
            redis.RedisError: Redis could not be read.
        """
        spec, stop = self.rdv.spec, None
        if self._peers is None:
            self._peers = self.rdv.peers()
        # The leases first: a peer writes its failure, its done mark or the gang's preemption
        # before its lease goes.
        lost = self.rdv.lost_peer(self._peers, self._jobs) if self._peers else None
        failed, current, preempt = self.rdv.look()
        if failed is None and preempt is not None and preempt[0] == self.generation:
            self.made_way(preempt[1])
            return StopJob(job_id=self.job_id, reason=StopReason.PREEMPT, grace_s=self.preempt_grace_s, level=preempt[1],
                           message=f"{spec.id} ({self.rdv.device}, rank {self.rdv.rank}) made way as a whole "
                                   f"for {preempt[1].value} work; it goes back to its queues and runs again")
        if failed is None and lost is not None and current == self.generation:
            logger.warning("%s: rank %d of %s: %s; moving the gang on from generation %d", self.rdv.device,
                           self.rdv.rank, spec.id, lost, self.generation)
            try:
                current = self.rdv.move_on(self.generation, lost)
            except GangFailed as exc:
                failed = str(exc).removeprefix(f"distributed job {spec.id}: ")
        if failed is not None:
            stop = StopJob(job_id=self.job_id, reason=StopReason.GANG, message=f"distributed job {spec.id}: {failed}")
        elif current is not None and current != self.generation:
            why = f" ({lost})" if lost is not None else ""
            stop = StopJob(job_id=self.job_id, reason=StopReason.GANG,
                           message=f"{spec.id} moved on from generation {self.generation} to {current}{why}")
        return stop


def run_rank(client: redis.Redis, spec: GangSpec, device: str, address: str, expires_s: int,
             job: RunJob, watch: Watch, run: Callable[[RunJob, Watch], Ended], token: int = 0,
             level: Level = DEFAULT_LEVEL, preempt_grace_s: float = PREEMPT_GRACE_S) -> Ended:
    """Run ``job`` as the rank of gang ``spec`` on ``device`` (``run`` runs it in a job process):
    join, assemble, run; run it again with the gang when it restarts. ``token``: the fencing
    token of the attempt that holds the job's lease (0: none), recorded in the gang for its
    peers' watch (:class:`GangWatch`); ``level``: the gang's, its precedence in wait-die before
    its age; ``preempt_grace_s``: a rank's grace when its gang is preempted. Never raises: the
    :class:`Ended` says how it ended, ``give_way`` when an older gang needs the device (the
    caller sends its message back to the queue, :data:`~tasks.core.defaults.GIVE_WAY_S` later)."""
    if device not in spec.devices:
        return Ended.by_worker(GangFailed, f"{device} took a rank of {spec.id}, which runs on "
                               f"{', '.join(spec.devices)}: send distributed jobs with fan_out(..., distributed=True)",
                               pid=0, retired=None)
    rdv = Rendezvous(client, spec, device, host_name(), expires_s, task_id=job.job_id, token=token, level=level)
    try:
        return _run_rank(rdv, address, job, watch, run, preempt_grace_s)
    except GiveWay as exc:
        logger.info("%s: job %s %s: %s", device, job.job, job.job_id, exc)
        return Ended(outcome=Outcome.GIVE_WAY, finished=None, error=None, error_module=None, pid=0, retired=None)
    except GangFailed as exc:
        stop = watch.stop()
        if stop is not None and stop.reason is not StopReason.GANG and (stop := watch.act_on(stop)) is not None:
            # Every rank of a cancelled job is revoked: its entry says cancelled, not failed.
            return Ended.stopped(stop, f"{stop.message} ({exc})")
        return Ended.by_worker(GangFailed, str(exc), pid=0, retired=None)


def refuse_rank(client: redis.Redis, spec: GangSpec, device: str, why: str, expires_s: int) -> str:
    """Fail gang ``spec`` because ``device``'s worker will not run its rank (``why``: its device
    does not meet the job's constraints, :func:`tasks.worker.admission.admit`): its peers end at
    once naming it, rather than wait ``join_timeout_s`` for a rank that never joins. Returns the
    reason the gang failed for (an earlier one wins)."""
    rdv = Rendezvous(client, spec, device, host_name(), expires_s)
    failed = rdv.fail(f"rank {rdv.rank} on {device} was refused: {why}")
    client.expire(rdv.key, expires_s)  # failed before any rank joined: the hash lives as a joined one does
    return failed


def _run_rank(rdv: Rendezvous, address: str, job: RunJob, watch: Watch,
              run: Callable[[RunJob, Watch], Ended], preempt_grace_s: float = PREEMPT_GRACE_S) -> Ended:
    spec = rdv.spec
    jobs = JobState(rdv.client)
    gen = rdv.join()
    while True:
        stop = watch.stop()
        if stop is not None and (stop := watch.act_on(stop)) is not None:
            if stop.reason is StopReason.PREEMPT:  # between two runs: the gang makes way as a whole
                rdv.preempt(gen, stop.level or Level.URGENT)
            elif stop.reason is not StopReason.FENCED:  # a fenced rank leaves the gang to its peers (below)
                rdv.fail(f"rank {rdv.rank} on {rdv.device} was stopped: {stop.message}")
            return Ended.stopped(stop)
        assembled = rdv.wait(gen)
        gen = assembled.generation
        try:
            master_addr, master_port = (address, None) if rdv.rank == 0 else rdv.find_store(gen)
        except PeerLost as exc:
            logger.warning("%s: rank %d of %s: %s; following the gang", rdv.device, rdv.rank, spec.id, exc)
            gen = rdv.join(after=gen)
            continue
        rank = Rank(gang_id=spec.id, rank=rdv.rank, world_size=spec.world_size,
                    local_rank=assembled.local_rank(rdv.rank), generation=gen, max_restarts=spec.max_restarts,
                    backend=spec.backend, collective_timeout_s=spec.collective_timeout_s,
                    master_addr=master_addr, master_port=master_port)
        gang_watch = GangWatch(watch, rdv, job.job_id, gen, address, jobs, preempt_grace_s)
        try:
            ended = run(job.model_copy(update={"rank": rank}), gang_watch)
        finally:
            gang_watch.close()
        if ended.outcome is Outcome.OK:
            rdv.done()
            return ended
        if ended.outcome is not Outcome.FENCED and (stop := watch.stop()) is not None and \
                stop.reason is StopReason.FENCED and (stop := watch.act_on(stop)) is not None:
            ended = ended.under(stop)  # its worker fenced itself off it as the run ended
        if ended.outcome is Outcome.FENCED:
            # Cut off from Redis, its worker stopped it: the lease expires, the job is given back
            # and its next run joins the gang where its peers (who saw the lease go) moved it.
            # Failing the gang from here would undo that, once Redis is reachable again.
            return ended
        if ended.outcome is Outcome.PREEMPTED:  # told by the mark: back to its queue, as every rank
            return ended
        if (made_way := _preempted(rdv, gen, job.job_id, gang_watch)) is not None:
            # Its collective failed as a peer stopped for the gang's preemption: it made way too.
            return dataclasses.replace(ended, outcome=Outcome.PREEMPTED, stop=made_way)
        if ended.crashed and gen >= spec.max_restarts:
            # No restart left: the gang fails naming the crash, which this rank's entry keeps.
            rdv.fail(f"rank {rdv.rank} on {rdv.device} failed: JobCrashed: {ended.error.message if ended.error else ''}")
            return ended
        if ended.outcome is Outcome.PEER_LOST or ended.crashed:
            failed, _ = rdv.state()
            if failed is not None:
                raise GangFailed(f"distributed job {spec.id}: {failed}")
            logger.warning("%s: rank %d of %s lost %s in generation %d (%s); running it again with the gang",
                           rdv.device, rdv.rank, spec.id, "its process" if ended.crashed else "a peer", gen,
                           ended.error.message if ended.error is not None else "")
            gen = rdv.join(after=gen)
            continue
        what = f"{ended.error.type}: {ended.error.message}" if ended.error is not None else ended.outcome.value
        rdv.fail(f"rank {rdv.rank} on {rdv.device} failed: {what}")
        return ended
