"""A gang's rendezvous in Redis, one rank's side (:class:`Rendezvous`): its steps on the gang's
hash (:func:`tasks.core.keys.gang`) and claims (:mod:`tasks.core.claims`). The protocol as a
whole is :mod:`tasks.worker.gang`'s."""

from __future__ import annotations

import dataclasses
import logging
import time

import redis

from . import claims, keys
from .defaults import GANG_ALIVE_TTL_MS as ALIVE_TTL_MS
from .defaults import GANG_POLL_S as POLL_S
from .errors import GangFailed, GiveWay, PeerLost
from .jobstate import JobState
from .priority import DEFAULT_LEVEL, Level, precedence
from .records import GangSpec
from .replies import text

logger = logging.getLogger(__name__)

#: KEYS: gang hash, then device_claims(device) of every rank's device, in rank order.
#: ARGV: rank, host, mode ('fresh' | 'after:<gen>'), precedence, the gang's claim (``gang:<id>``,
#: :mod:`tasks.core.claims`), max restarts, TTL s, the
#: rank's task id and its attempt's fencing token ('' and '0' for a run under no lease).
#: Join the current generation (recording the rank's task and token, whose lease its peers watch); first move the gang to the next one when this rank's earlier
#: run joined a generation that had assembled (it died in it: 'fresh'), or when a collective of
#: generation <gen> failed ('after:<gen>'). The gang claims the devices whose rank has not joined
#: the generation, none once it is complete. Returns {generation, ''} or {-1, why it failed}.
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

#: KEYS: gang hash, then every rank's device_claims key. ARGV: the gang's claim, why.
#: Fail the gang (the first reason stays) and stop holding any device for it.
_FAIL = """
redis.call('hsetnx', KEYS[1], 'failed', ARGV[2])
for i = 2, #KEYS do redis.call('zrem', KEYS[i], ARGV[1]) end
return redis.call('hget', KEYS[1], 'failed')
"""

#: KEYS: gang hash, then every rank's device_claims key. ARGV: generation, max restarts, the gang's claim,
#: why (:meth:`Rendezvous.move_on`; nothing if the gang moved on or failed meanwhile). Returns
#: {generation, ''} or {-1, why it failed}.
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

#: KEYS: gang hash, this rank's device_claims key. ARGV: the gang's claim, precedence, generation, rank.
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
        self._claims = [keys.device_claims(d) for d in spec.devices]
        #: Its claim in its devices' claim sets (:mod:`tasks.core.claims`).
        self.claim = claims.member(claims.GANG, spec.id)
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
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.gang_alive(self.spec.id), 1, px=ALIVE_TTL_MS)  # its claims are live as they are written
        self._join(keys=[self.key, *self._claims], args=[
            self.rank, self.host, mode, self.precedence, self.claim, self.spec.max_restarts,
            self.expires_s, self.task_id, self.token], client=pipe)
        claims.nudge(pipe, *self.spec.devices)  # their keepers see the claims it wrote or dropped
        gen, why = pipe.execute()[1]
        if int(gen) < 0:
            raise GangFailed(f"distributed job {self.spec.id}: {text(why)}")
        return int(gen)

    def move_on(self, gen: int, why: str) -> int:
        """Move the gang past generation ``gen``, in which a peer was lost (``why``), as a failed
        collective does (:meth:`join` ``after=gen``) but without joining the next: returns the
        gang's generation now.

        Raises:
            GangFailed: the gang has failed, or this used up its restarts.
        """
        gen, failed = self._move_on(keys=[self.key, *self._claims],
                                    args=[gen, self.spec.max_restarts, self.claim, why])
        if int(gen) < 0:
            raise GangFailed(f"distributed job {self.spec.id}: {text(failed)}")
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
                out[r] = (text(task_id), int(token))
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
        failed = text(self._fail(keys=[self.key, *self._claims], args=[self.claim, why]))
        claims.nudge(self.client.pipeline(transaction=False), *self.spec.devices).execute()
        return failed

    def state(self) -> tuple[str | None, int | None]:
        """Why the gang failed (None: it has not) and its current generation."""
        failed, current, _ = self.look()
        return failed, current

    def look(self) -> tuple[str | None, int | None, tuple[int, Level] | None]:
        """:meth:`state`, and the generation a preemption ended with the level it was for
        (None: never preempted), in one read."""
        failed, current, mark = self.client.hmget(self.key, ["failed", "gen", "preempt"])
        gen, _, level = text(mark).partition(":") if mark else ("", "", "")
        return ((text(failed) if failed else None), (int(current) if current is not None else None),
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
            GiveWay: a live claim of higher precedence (older, or of a higher level) is on this
                device: a gang that is assembling, or a device group (:mod:`tasks.core.claims`).
        """
        deadline = time.monotonic() + self.spec.join_timeout_s
        claimed = keys.device_claims(self.device)
        while True:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.gang_alive(self.spec.id), 1, px=ALIVE_TTL_MS)
            pipe.hgetall(self.key)
            claims.read_before(pipe, self.device, self.precedence)
            _, fields, older = pipe.execute()
            fields = {text(k): text(v) for k, v in fields.items()}
            if "failed" in fields:
                raise GangFailed(f"distributed job {self.spec.id}: {fields['failed']}")
            current = int(fields.get("gen", gen))
            if current != gen:
                gen = self.join(after=None)
                continue
            hosts = {r: fields.get(f"m:{gen}:{r}") for r in range(self.spec.world_size)}
            if all(hosts.values()):
                return Assembled(gen, {r: str(h) for r, h in hosts.items()})
            if give_way and older and (first := claims.before(self.client, [(self.device, older)])) is not None:
                self._leave(keys=[self.key, claimed], args=[self.claim, self.precedence, gen, self.rank])
                claims.nudge(self.client.pipeline(transaction=False), self.device).execute()
                raise GiveWay(self.device, str(first[1]))
            if time.monotonic() > deadline:
                missing = [d for r, d in enumerate(self.spec.devices) if not hosts[r]]
                why = (f"{', '.join(missing)} did not join within join_timeout_s="
                       f"{self.spec.join_timeout_s:g} (rank {self.rank} on {self.device} waited; is "
                       f"{'its' if len(missing) == 1 else 'their'} worker up and free?)")
                raise GangFailed(f"distributed job {self.spec.id}: {self.fail(why)}")
            time.sleep(POLL_S)

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
        host, _, port = text(published).rpartition(":")
        return host, int(port)
