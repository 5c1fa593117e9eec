"""Distributed jobs: the ranks of one ``torch.distributed`` job, gang-started on fleet devices.

``tasks.fan_out(job, devices, distributed=True)`` sends one message per device, each carrying
the gang's :class:`~tasks.core.records.GangSpec` in its options; rank ``i`` is the job on
``devices[i]``. A worker that takes a rank (:func:`run_rank`):

1. joins the gang's rendezvous, one Redis hash (:func:`tasks.core.keys.gang`), in the current
   generation, and waits until every rank has joined it. A rank that waits longer than
   ``join_timeout_s`` fails the gang with a message naming the devices that did not come;
2. rank 0 opens a ``TCPStore`` on a port the OS picks (no free-port race) and publishes its
   address; every rank connects to it and calls ``init_process_group`` with the gang's backend
   and ``timeout=collective_timeout_s`` (not torch's 30 minutes). ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set as torchrun sets them;
3. runs the job with ``ctx.distributed`` set, and destroys the process group on every exit
   path: no rank holds a group across jobs.

**Restarts.** A rank whose worker dies runs again on its device (the lease's reaper gives its
message back, :mod:`tasks.worker.lease`). Its peers' next collective fails (gloo: "Connection
reset by peer"; a hung peer: the collective timeout); they move the gang to the next generation
and wait there. The rank's fresh run finds the generation it had joined complete, so it moves
the gang on too; all meet in the next generation and the job resumes from its checkpoint
(``train`` saves one). After ``max_restarts`` generations the gang fails. Any other error of a
rank's job fails the gang at once: the peers stop waiting and fail naming it.

**No deadlock.** Two gangs over overlapping devices could each hold a device the other waits
for. The producer sends each gang's ranks under one lock (``keys.GANG_SEND_LOCK``), so every
device's queue holds one gang's ranks before the next's; but order alone is not enough (the
reaper gives a dead worker's rank back at the front of its queue after its restarted worker may
have taken another gang's rank). So ranks also follow *wait-die* (Rosenkrantz, Stearns and
Lewis, 1978): a gang's ``seq`` is its age; a rank waiting for its gang on a device that an
older, still assembling gang needs (``keys.gangs_needing``) gives the device up (its message
goes back to the queue, :class:`GiveWay`) and comes back later. A younger gang waits only for
older ones and never the other way round, so no cycle of waits can form; a gang that has
assembled never gives way, it runs to its end.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from ..core import keys
from ..core.defaults import GANG_ALIVE_TTL_MS as ALIVE_TTL_MS
from ..core.defaults import GANG_POLL_S as POLL_S
from ..core.errors import DeviceFleetError, GangFailed, JobCancelled
from ..core.job import DistributedInfo, JobContext
from ..core.records import GangSpec

logger = logging.getLogger(__name__)

#: The torch.distributed environment of torchrun, set while a rank's job runs.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Words in a RuntimeError that mean a collective lost a peer (gloo's transport errors are plain
#: RuntimeErrors: "Connection reset by peer", "Connection closed by peer", "Timed out").
PEER_LOST_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "timed out", "socket")

#: KEYS: gang hash, then gangs_needing(device) of every rank's device, in rank order.
#: ARGV: rank, host, mode ('fresh' | 'after:<gen>'), seq, gang id, max restarts, TTL s.
#: Join the current generation; first move the gang to the next one when this rank's earlier
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
  if gen > tonumber(ARGV[6]) then
    local why = 'gave up after ' .. ARGV[6] .. ' restarts (a rank died or lost its peers each time)'
    redis.call('hset', gang, 'failed', why)
    for r = 0, world - 1 do redis.call('zrem', KEYS[r + 2], ARGV[5]) end
    return {-1, why}
  end
end
redis.call('hset', gang, 'gen', gen, 'm:' .. gen .. ':' .. ARGV[1], ARGV[2])
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

#: KEYS: gang hash, this rank's gangs_needing key. ARGV: gang id, seq, generation, rank.
#: Leave the generation (to give the device up): the gang needs this device again.
_LEAVE = """
if redis.call('hget', KEYS[1], 'gen') == ARGV[3] and not redis.call('hget', KEYS[1], 'failed') then
  redis.call('hdel', KEYS[1], 'm:' .. ARGV[3] .. ':' .. ARGV[4])
  redis.call('zadd', KEYS[2], ARGV[2], ARGV[1])
end
return 1
"""


class GiveWay(DeviceFleetError):
    """A rank gives its device up to an older gang that needs it; the runner sends its message
    back to the queue (``task.retry``), to run again in :data:`~tasks.core.defaults.GIVE_WAY_S`."""

    def __init__(self, device: str, older: str) -> None:
        super().__init__(f"{device} is needed by the older gang {older}; this rank comes back later")
        self.device = device
        self.older = older


class PeerLost(DeviceFleetError):
    """The gang moved to a later generation while this rank was joining its group (a peer
    died and ran again): this rank follows it there."""


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A generation in which every rank has joined."""

    generation: int
    #: ``{rank: host}`` of the generation's ranks.
    hosts: dict[int, str]


class Rendezvous:
    """One rank's side of its gang's rendezvous in Redis."""

    def __init__(self, client: redis.Redis, spec: GangSpec, device: str, host: str,
                 expires_s: int) -> None:
        self.client = client
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

    def join(self, after: int | None = None) -> int:
        """Join the current generation and return it; ``after``: the generation whose
        collective just failed (the gang moves past it).

        Raises:
            GangFailed: the gang has failed or used up its restarts.
        """
        mode = "fresh" if after is None else f"after:{after}"
        gen, why = self._join(keys=[self.key, *self._needing], args=[
            self.rank, self.host, mode, self.spec.seq, self.spec.id, self.spec.max_restarts,
            self.expires_s])
        if int(gen) < 0:
            raise GangFailed(f"distributed job {self.spec.id}: {_text(why)}")
        return int(gen)

    def fail(self, why: str) -> str:
        """Fail the gang (the first reason given wins) and return the reason it failed for."""
        return _text(self._fail(keys=[self.key, *self._needing], args=[self.spec.id, why]))

    def wait(self, gen: int, give_way: bool = True) -> Assembled:
        """Wait until every rank has joined generation ``gen`` (joining again if the gang has
        moved on meanwhile).

        Raises:
            GangFailed: the gang failed, or the wait outlasted ``join_timeout_s`` (the message
                names the devices that did not come).
            GiveWay: an older gang that is assembling needs this device.
        """
        deadline = time.monotonic() + self.spec.join_timeout_s
        needing = keys.gangs_needing(self.device)
        while True:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.gang_alive(self.spec.id), 1, px=ALIVE_TTL_MS)
            pipe.hgetall(self.key)
            pipe.zrangebyscore(needing, "-inf", f"({self.spec.seq}", start=0, num=8)
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
                    self._leave(keys=[self.key, needing], args=[self.spec.id, self.spec.seq, gen, self.rank])
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

    def master(self, gen: int, address: str) -> tuple[str, int, Any]:
        """Rank 0: open the gang's TCP store and publish it. Others: wait for it and connect.
        Returns ``(address, port, store)``.

        Raises:
            GangFailed: rank 0 did not publish its store within the join timeout.
            PeerLost: the gang moved on to another generation meanwhile.
        """
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.spec.collective_timeout_s)
        field = f"master:{gen}"
        if self.rank == 0:
            store = dist.TCPStore(address, 0, world_size=self.spec.world_size, is_master=True,
                                  wait_for_workers=False, timeout=timeout)
            self.client.hset(self.key, field, f"{address}:{store.port}")
            return address, int(store.port), store
        deadline = time.monotonic() + self.spec.join_timeout_s
        while not (published := self.client.hget(self.key, field)):
            failed, current = self.client.hmget(self.key, ["failed", "gen"])
            if failed or time.monotonic() > deadline:
                raise GangFailed(f"distributed job {self.spec.id}: rank 0 on {self.spec.devices[0]} "
                                 "did not open its store")
            if current is not None and int(current) != gen:
                raise PeerLost(f"{self.spec.id} moved on from generation {gen} to {int(current)}")
            time.sleep(POLL_S)
        host, _, port = _text(published).rpartition(":")
        store = dist.TCPStore(host, int(port), world_size=self.spec.world_size, is_master=False,
                              timeout=timeout)
        return host, int(port), store


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective lost a peer (the gang restarts), not that the job
    itself failed (the gang fails)."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistError, PeerLost)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in PEER_LOST_MARKERS)


@contextmanager
def torchrun_env(info: DistributedInfo) -> Iterator[None]:
    """Set torchrun's variables while a rank's job runs (a worker runs one job at a time)."""
    saved = {name: os.environ.get(name) for name in TORCHRUN_ENV}
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.local_rank), MASTER_ADDR=info.master_addr,
                      MASTER_PORT=str(info.master_port))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def process_group(rdv: Rendezvous, assembled: Assembled, address: str) -> Iterator[DistributedInfo]:
    """The gang's process group for one generation, destroyed on every exit path."""
    import torch.distributed as dist

    spec = rdv.spec
    master_addr, master_port, store = rdv.master(assembled.generation, address)
    try:
        dist.init_process_group(spec.backend, store=store, rank=rdv.rank, world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=spec.collective_timeout_s))
    except BaseException:
        del store
        raise
    same_host = [r for r in sorted(assembled.hosts) if assembled.hosts[r] == rdv.host]
    info = DistributedInfo(rank=rdv.rank, world_size=spec.world_size,
                           local_rank=same_host.index(rdv.rank) if rdv.rank in same_host else 0,
                           backend=spec.backend, restarts=assembled.generation,
                           master_addr=master_addr, master_port=master_port)
    try:
        with torchrun_env(info):
            yield info
    finally:
        dist.destroy_process_group()
        del store


def run_rank(func: Callable[[JobContext, Any], dict[str, Any]], ctx: JobContext, params: Any,
             rdv: Rendezvous, address: str) -> dict[str, Any]:
    """Run one rank of a distributed job: join, assemble, run; restart with the gang when a
    peer is lost. The output gains ``rank``, ``world_size``, ``backend`` and ``restarts``.

    Raises:
        GangFailed: the gang failed (a rank did not come, a rank's job raised, no restarts left).
        GiveWay: an older gang needs this device; the message goes back to the queue.
        Exception: this rank's job raised (the gang fails with it).
    """
    try:
        return _run_rank(func, ctx, params, rdv, address)
    except GangFailed as exc:
        if ctx.cancelled is not None and ctx.cancelled():
            # Every rank of a cancelled job is revoked: its entry says cancelled, not failed.
            raise JobCancelled(f"rank {rdv.rank} of {rdv.spec.id} on {rdv.device} was cancelled ({exc})") from None
        raise


def _run_rank(func: Callable[[JobContext, Any], dict[str, Any]], ctx: JobContext, params: Any,
              rdv: Rendezvous, address: str) -> dict[str, Any]:
    gen = rdv.join()
    while True:
        if ctx.cancelled is not None and ctx.cancelled():
            rdv.fail(f"rank {rdv.rank} on {rdv.device} was cancelled")
            raise JobCancelled(f"rank {rdv.rank} of {rdv.spec.id} on {rdv.device} was cancelled")
        assembled = rdv.wait(gen)
        try:
            with process_group(rdv, assembled, address) as info:
                logger.info("%s: rank %d of %d (%s) of %s, generation %d", rdv.device, info.rank,
                            info.world_size, info.backend, rdv.spec.id, info.restarts)
                try:
                    output = func(dataclasses.replace(ctx, distributed=info), params)
                except Exception as exc:
                    if not peer_lost(exc):
                        # Before the group goes: the peers that see it go find the reason.
                        rdv.fail(f"rank {rdv.rank} on {rdv.device} failed: {type(exc).__name__}: {exc}")
                    raise
        except GangFailed:
            raise
        except Exception as exc:
            if not peer_lost(exc):
                # The job's error (already given), or the group's setup failed here.
                rdv.fail(f"rank {rdv.rank} on {rdv.device} failed: {type(exc).__name__}: {exc}")
                raise
            logger.warning("%s: rank %d of %s lost a peer in generation %d (%s); restarting the gang",
                           rdv.device, rdv.rank, rdv.spec.id, assembled.generation, exc)
            gen = rdv.join(after=assembled.generation)
            continue
        return {**output, "rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                "restarts": info.restarts}
