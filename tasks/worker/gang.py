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
   (its lease gone or a newer attempt's: its host cut off from Redis, or its worker dead) moves
   the gang on first, within the lease TTL, where its collective would hang until
   ``collective_timeout_s``.

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
gang's hash (:meth:`Rendezvous.preempt`), and every rank's watch, its own included, reads the
mark at its next look (:data:`~tasks.core.defaults.GANG_WATCH_INTERVAL_S`) and stops its rank
with the preemption's grace. Each rank goes back to the front of its queue (a preemption, not a
failure: no death, no restart counted) and the gang assembles again in its next generation once
every device has taken its rank back; the generation a preemption ended is not counted against
``max_restarts``. A rank whose collective failed because a peer stopped first finds the mark
too (it is written before any rank stops).

**No deadlock.** Two gangs over overlapping devices could each hold a device the other waits
for. The producer sends each gang's ranks under one lock (``keys.GANG_SEND_LOCK``), so every
device's queue holds one gang's ranks before the next's; but order alone is not enough (the
reaper gives a dead worker's rank back at the front of its queue after its restarted worker may
have taken another gang's rank). So ranks also follow *wait-die* (Rosenkrantz, Stearns and
Lewis, 1978) over a gang's *precedence*: its level first (a higher level wins, whatever the
ages), then its ``seq``, its age: :func:`tasks.core.priority.precedence`, the one rule device
groups follow too (:attr:`Rendezvous.precedence`). A
rank waiting for its gang on a device that a gang of higher precedence, still assembling, needs
(``keys.gangs_needing``, scored by precedence) gives the device up (its message goes back to
the queue, :class:`~tasks.core.errors.GiveWay`) and comes back
:data:`~tasks.core.defaults.GIVE_WAY_S` later. A gang waits only for gangs of higher precedence
and never the other way round (the order is total and a gang's precedence never changes), so
no cycle of waits can form; a gang that has assembled never gives way, it runs to its end.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis

from ..core import keys
from ..core.defaults import GANG_ALIVE_TTL_MS as ALIVE_TTL_MS
from ..core.defaults import GANG_POLL_S as POLL_S
from ..core.defaults import GANG_WATCH_INTERVAL_S as WATCH_INTERVAL_S
from ..core.defaults import PREEMPT_GRACE_S
from ..core.devices import host_name
from ..core.errors import GangFailed, GiveWay, PeerLost
from ..core.jobstate import JobState
from ..core.priority import DEFAULT_LEVEL, Level, precedence
from ..core.records import GangSpec
from ..core.sentinel import first_host, is_sentinel
from ..core.wire import ModeMessage, Outcome, Proceed, Rank, RankFailed, RunJob, StopJob, StopReason, StoreOpened
from .supervisor import Ended, Watch, WatchOver

logger = logging.getLogger(__name__)

#: KEYS: gang hash, then gangs_needing(device) of every rank's device, in rank order.
#: ARGV: rank, host, mode ('fresh' | 'after:<gen>'), precedence, gang id, max restarts, TTL s, the
#: rank's task id and its attempt's fencing token ('' and '0' for a run under no lease).
#: Join the current generation (recording the rank's task and token, whose lease its peers watch); first move the gang to the next one when this rank's earlier
#: run joined a generation that had assembled (it died in it: 'fresh'), or when a collective of
#: generation <gen> failed ('after:<gen>'). Returns {generation, ''} or {-1, why it failed}.
_JOIN = """
local gang = KEYS[1]
local world = #KEYS - 1
local failed = redis.call('hget', gang, 'failed')
if failed then return {-1, failed} end
local gen = tonumber(redis.call('hget', gang, 'gen') or '0')
local function joined(g)
  local n = 0
  for r = 0, world - 1 do
    if redis.call('hexists', gang, 'm:' .. g .. ':' .. r) == 1 then n = n + 1 end
  end
  return n
end
local bump = false
if ARGV[3] == 'fresh' then
  bump = redis.call('hexists', gang, 'm:' .. gen .. ':' .. ARGV[1]) == 1 and joined(gen) == world
else
  bump = tonumber(string.sub(ARGV[3], 7)) == gen
end
if bump then
  gen = gen + 1
  if gen - tonumber(redis.call('hget', gang, 'preempted') or '0') > tonumber(ARGV[6]) then
    local why = 'gave up after ' .. ARGV[6] .. ' restarts (a rank died or lost its peers each time)'
    redis.call('hset', gang, 'failed', why)
    for r = 0, world - 1 do redis.call('zrem', KEYS[r + 2], ARGV[5]) end
    return {-1, why}
  end
end
redis.call('hset', gang, 'gen', gen, 'm:' .. gen .. ':' .. ARGV[1], ARGV[2])
if ARGV[8] ~= '' then
  redis.call('hset', gang, 'task:' .. ARGV[1], ARGV[8], 'token:' .. ARGV[1], ARGV[9])
end
local complete = joined(gen) == world
for r = 0, world - 1 do
  if complete or redis.call('hexists', gang, 'm:' .. gen .. ':' .. r) == 1 then
    redis.call('zrem', KEYS[r + 2], ARGV[5])
  else
    redis.call('zadd', KEYS[r + 2], ARGV[4], ARGV[5])
  end
end
redis.call('expire', gang, ARGV[7])
return {gen, ''}
"""

#: KEYS: gang hash, then every rank's gangs_needing key. ARGV: gang id, why.
#: Fail the gang (the first reason stays) and stop holding any device for it.
_FAIL = """
redis.call('hsetnx', KEYS[1], 'failed', ARGV[2])
for i = 2, #KEYS do redis.call('zrem', KEYS[i], ARGV[1]) end
return redis.call('hget', KEYS[1], 'failed')
"""

#: KEYS: gang hash, then every rank's gangs_needing key. ARGV: generation, max restarts, gang id,
#: why. A rank's watch found a peer lost in generation <gen> (its lease gone, or a newer attempt's):
#: move the gang to the next generation, or fail it once the restarts are spent, as the join
#: does for a failed collective; nothing if the gang moved on or failed meanwhile. Returns the
#: generation it moved to, or -1 with why it failed.
_MOVE_ON = """
local gang = KEYS[1]
local failed = redis.call('hget', gang, 'failed')
if failed then return {-1, failed} end
local gen = tonumber(redis.call('hget', gang, 'gen') or '0')
if gen ~= tonumber(ARGV[1]) then return {gen, ''} end
if gen + 1 - tonumber(redis.call('hget', gang, 'preempted') or '0') > tonumber(ARGV[2]) then
  local why = 'gave up after ' .. ARGV[2] .. ' restarts (' .. ARGV[4] .. ')'
  redis.call('hset', gang, 'failed', why)
  for i = 2, #KEYS do redis.call('zrem', KEYS[i], ARGV[3]) end
  return {-1, why}
end
redis.call('hset', gang, 'gen', gen + 1)
return {gen + 1, ''}
"""

#: KEYS: gang hash. ARGV: generation, level. Mark generation <gen> preempted for <level> work
#: ('preempt' = '<gen>:<level>'; 'preempted' counts the generations so ended, which the restart
#: budget leaves out), unless the gang failed or moved on. Returns 1 if the mark (this one or an
#: earlier one for the same generation) is there.
_PREEMPT = """
if redis.call('hget', KEYS[1], 'failed') or redis.call('hget', KEYS[1], 'gen') ~= ARGV[1] then return 0 end
local mark = redis.call('hget', KEYS[1], 'preempt')
if mark and string.sub(mark, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then return 1 end
redis.call('hset', KEYS[1], 'preempt', ARGV[1] .. ':' .. ARGV[2])
redis.call('hincrby', KEYS[1], 'preempted', 1)
return 1
"""

#: KEYS: gang hash, this rank's gangs_needing key. ARGV: gang id, precedence, generation, rank.
#: Leave the generation (to give the device up): the gang needs this device again.
_LEAVE = """
if redis.call('hget', KEYS[1], 'gen') == ARGV[3] and not redis.call('hget', KEYS[1], 'failed') then
  redis.call('hdel', KEYS[1], 'm:' .. ARGV[3] .. ':' .. ARGV[4])
  redis.call('zadd', KEYS[2], ARGV[2], ARGV[1])
end
return 1
"""


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A generation in which every rank has joined."""

    generation: int
    #: ``{rank: host}`` of the generation's ranks.
    hosts: dict[int, str]

    def local_rank(self, rank: int) -> int:
        """``rank``'s index among the generation's ranks on its host, as torchrun numbers them."""
        same_host = [r for r in sorted(self.hosts) if self.hosts[r] == self.hosts.get(rank)]
        return same_host.index(rank) if rank in same_host else 0


class Rendezvous:
    """One rank's side of its gang's rendezvous in Redis."""

    def __init__(self, client: redis.Redis, spec: GangSpec, device: str, host: str,
                 expires_s: int, task_id: str = "", token: int = 0, level: Level = DEFAULT_LEVEL) -> None:
        self.client = client
        #: The gang's place in wait-die (lower goes first): its level, then its age. A ``normal``
        #: gang's is its ``seq`` (:func:`tasks.core.priority.precedence`).
        self.precedence = precedence(level, spec.seq)
        #: This rank's task and its attempt's fencing token (recorded at join: its peers watch
        #: its lease); '' and 0 for a run under no lease (called in process).
        self.task_id = task_id if token else ""
        self.token = token
        self.spec = spec
        self.device = device
        self.rank = spec.rank_of(device)
        self.host = host
        self.expires_s = expires_s
        self.key = keys.gang(spec.id)
        self._needing = [keys.gangs_needing(d) for d in spec.devices]
        self._join = client.register_script(_JOIN)
        self._fail = client.register_script(_FAIL)
        self._leave = client.register_script(_LEAVE)
        self._move_on = client.register_script(_MOVE_ON)
        self._preempt = client.register_script(_PREEMPT)

    def join(self, after: int | None = None) -> int:
        """Join the current generation and return it; ``after``: the generation whose
        collective just failed (the gang moves past it).

        Raises:
            GangFailed: the gang has failed or used up its restarts.
        """
        mode = "fresh" if after is None else f"after:{after}"
        gen, why = self._join(keys=[self.key, *self._needing], args=[
            self.rank, self.host, mode, self.precedence, self.spec.id, self.spec.max_restarts,
            self.expires_s, self.task_id, self.token])
        if int(gen) < 0:
            raise GangFailed(f"distributed job {self.spec.id}: {_text(why)}")
        return int(gen)

    def move_on(self, gen: int, why: str) -> int:
        """Move the gang past generation ``gen``, in which a peer was lost (``why``), as a failed
        collective does (:meth:`join` ``after=gen``) but without joining the next: returns the
        gang's generation now.

        Raises:
            GangFailed: the gang has failed, or this used up its restarts.
        """
        gen, failed = self._move_on(keys=[self.key, *self._needing],
                                    args=[gen, self.spec.max_restarts, self.spec.id, why])
        if int(gen) < 0:
            raise GangFailed(f"distributed job {self.spec.id}: {_text(failed)}")
        return int(gen)

    def done(self) -> None:
        """This rank's job ended ok: its lease goes with its result, and its peers, still
        finishing theirs, must not take that for a lost peer. Best effort."""
        try:
            self.client.hset(self.key, f"done:{self.rank}", 1)
        except redis.RedisError as exc:  # a peer may then take it for lost and restart the gang's last bit
            logger.warning("%s: could not mark rank %d of %s done: %s", self.device, self.rank, self.spec.id, exc)

    def peers(self) -> dict[int, tuple[str, int]]:
        """``{rank: (task id, token)}`` of the other ranks that joined under a lease."""
        others = [r for r in range(self.spec.world_size) if r != self.rank]
        fields = [f"{what}:{r}" for r in others for what in ("task", "token")]
        values = self.client.hmget(self.key, fields) if fields else []
        out: dict[int, tuple[str, int]] = {}
        for i, r in enumerate(others):
            task_id, token = values[2 * i], values[2 * i + 1]
            if task_id and token:
                out[r] = (_text(task_id), int(token))
        return out

    def lost_peer(self, peers: dict[int, tuple[str, int]], jobs: JobState) -> str | None:
        """Why one of ``peers`` (:meth:`peers`) is lost, from the fleet: its lease is gone
        (expired, reaped) while it had not ended ok, or a newer attempt of its job holds it;
        ``None`` if none is. Two round trips: the leases first, then the gang's ``done`` marks,
        which a rank writes before its lease goes."""
        ranks = sorted(peers)
        tokens = jobs.lease_tokens([peers[r][0] for r in ranks])
        gone = [(r, token) for r, token in zip(ranks, tokens, strict=True) if token != peers[r][1]]
        if not gone:
            return None
        done = self.client.hmget(self.key, [f"done:{r}" for r, _ in gone])
        for (r, token), finished in zip(gone, done, strict=True):
            if finished:
                continue
            device = self.spec.devices[r]
            if token is None:
                return f"rank {r} on {device} lost its lease (its worker is cut off from Redis, or died)"
            return f"rank {r} on {device}: a newer attempt (token {token}) holds its job"
        return None

    def fail(self, why: str) -> str:
        """Fail the gang (the first reason given wins) and return the reason it failed for."""
        return _text(self._fail(keys=[self.key, *self._needing], args=[self.spec.id, why]))

    def state(self) -> tuple[str | None, int | None]:
        """Why the gang failed (None: it has not) and its current generation."""
        failed, current, _ = self.look()
        return failed, current

    def look(self) -> tuple[str | None, int | None, tuple[int, Level] | None]:
        """:meth:`state`, and the generation a preemption ended with the level it was for
        (None: never preempted), in one read."""
        failed, current, mark = self.client.hmget(self.key, ["failed", "gen", "preempt"])
        gen, _, level = _text(mark).partition(":") if mark else ("", "", "")
        return ((_text(failed) if failed else None), (int(current) if current is not None else None),
                (int(gen), Level(level)) if gen else None)

    def preempt(self, gen: int, level: Level) -> bool:
        """Mark generation ``gen`` preempted for ``level`` work: every rank's watch stops its
        rank. False if the gang failed or moved on from ``gen`` meanwhile."""
        return bool(self._preempt(keys=[self.key], args=[gen, level.value]))

    def wait(self, gen: int, give_way: bool = True) -> Assembled:
        """Wait until every rank has joined generation ``gen`` (joining again if the gang has
        moved on meanwhile).

        Raises:
            GangFailed: the gang failed, or the wait outlasted ``join_timeout_s`` (the message
                names the devices that did not come).
            GiveWay: a gang of higher precedence (older, or of a higher level) that is
                assembling needs this device.
        """
        deadline = time.monotonic() + self.spec.join_timeout_s
        needing = keys.gangs_needing(self.device)
        while True:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.gang_alive(self.spec.id), 1, px=ALIVE_TTL_MS)
            pipe.hgetall(self.key)
            pipe.zrangebyscore(needing, "-inf", f"({self.precedence}", start=0, num=8)
            _, fields, older = pipe.execute()
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if "failed" in fields:
                raise GangFailed(f"distributed job {self.spec.id}: {fields['failed']}")
            current = int(fields.get("gen", gen))
            if current != gen:
                gen = self.join(after=None)
                continue
            hosts = {r: fields.get(f"m:{gen}:{r}") for r in range(self.spec.world_size)}
            if all(hosts.values()):
                return Assembled(gen, {r: str(h) for r, h in hosts.items()})
            if give_way and older:
                alive = [_text(g) for g, up in zip(older, self._alive(older), strict=True) if up]
                if alive:
                    self._leave(keys=[self.key, needing], args=[self.spec.id, self.precedence, gen, self.rank])
                    raise GiveWay(self.device, alive[0])
            if time.monotonic() > deadline:
                missing = [d for r, d in enumerate(self.spec.devices) if not hosts[r]]
                why = (f"{', '.join(missing)} did not join within join_timeout_s="
                       f"{self.spec.join_timeout_s:g} (rank {self.rank} on {self.device} waited; is "
                       f"{'its' if len(missing) == 1 else 'their'} worker up and free?)")
                raise GangFailed(f"distributed job {self.spec.id}: {self.fail(why)}")
            time.sleep(POLL_S)

    def _alive(self, gangs: list[Any]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for gang_id in gangs:
            pipe.exists(keys.gang_alive(_text(gang_id)))
        return [bool(n) for n in pipe.execute()]

    def publish_store(self, gen: int, address: str, port: int) -> None:
        """Rank 0's store for generation ``gen`` listens at ``address:port``."""
        self.client.hset(self.key, f"master:{gen}", f"{address}:{port}")

    def find_store(self, gen: int) -> tuple[str, int]:
        """Wait until rank 0 has published its store for generation ``gen``: ``(address, port)``.

        Raises:
            GangFailed: the gang failed, or rank 0 did not publish its store within the join timeout.
            PeerLost: the gang moved on to another generation meanwhile.
        """
        deadline = time.monotonic() + self.spec.join_timeout_s
        field = f"master:{gen}"
        while not (published := self.client.hget(self.key, field)):
            failed, current = self.state()
            if failed or time.monotonic() > deadline:
                raise GangFailed(f"distributed job {self.spec.id}: rank 0 on {self.spec.devices[0]} "
                                 "did not open its store" + (f" ({failed})" if failed else ""))
            if current is not None and current != gen:
                raise PeerLost(f"{self.spec.id} moved on from generation {gen} to {current}")
            time.sleep(POLL_S)
        host, _, port = _text(published).rpartition(":")
        return host, int(port)


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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GangWatch(WatchOver):
    """The watch of one rank's run in one generation: the job's own watch (progress, stops), and
    the gang's side of it: rank 0's store published, a rank's own failure failing the gang, a
    gang that failed or moved on stopping the rank, and a lost peer moving the gang on.

    A peer is lost when the fleet says so (:meth:`Rendezvous.lost_peer`): its lease is gone (its
    worker cut off from Redis, which stops the rank itself, or dead) or a newer attempt holds its
    job. Its collective would wait out ``collective_timeout_s`` for a peer that cannot answer (a
    cut-off host drops every packet: nothing resets the connection), so the watch moves the gang
    to its next generation itself (:meth:`Rendezvous.move_on`: a restart, or the gang fails once
    its restarts are spent) within the lease TTL and :data:`~tasks.core.defaults.GANG_WATCH_INTERVAL_S` of the peer's last
    renewal, and the rank is stopped as for a gang that moved on.

    The gang is read from a thread of its own, every :data:`~tasks.core.defaults.GANG_WATCH_INTERVAL_S`: the supervisor's
    loop, which asks :meth:`stop`, never waits on Redis (a cut-off worker's reads hang for as long
    as its TCP retries last, and its own job's self-fencing must not wait for them). :meth:`close`
    ends it.

    A preemption its own worker asks for (the inner watch's ``StopReason.PREEMPT``, its message
    claimed as the supervisor acts on it) is held back until this thread has marked the gang
    preempted (:meth:`Rendezvous.preempt`): the rank then stops with every other, each told by
    the mark, its stop carrying the level it makes way for."""

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
    does not meet the job's constraints, :func:`tasks.worker.runner.execute`): its peers end at
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
