"""A job's life in Redis, in one place: every script that takes, renews, finishes and reaps a
job and counts the workers it took down, and the records they are handed.

The scripts run from two places, each where it must: the device worker's lease keeper and reaper
(:mod:`tasks.worker.lease`) and the result backend's store (:class:`tasks.core.backend.FleetBackend`,
through which every Celery path of storing a state goes). The record a job's lease holds is
:class:`tasks.core.records.LeaseRecord`; its keys are in :mod:`tasks.core.keys`.

A job's life, one script call a step:

1. **take** (:data:`TAKE`): unless its result is stored, the worker takes the job's lease
   ``keys.lease(task_id)`` (a TTL key, and ``{task id: lease}`` in ``keys.LEASES``) and stores
   its STARTED state. A lease held by a live owner refuses the copy (the job never runs twice at
   once); a dead owner's lease is taken over and its death counted (``keys.worker_deaths``); a
   job with ``max_attempts`` deaths is taken but not run (``lost``);
2. **renew** (:data:`RENEW`): the worker's lease keeper, a third of the TTL apart, while the job's
   process lives;
3. **finish** (:data:`STORE`): the result stored unless a finished one is there, with the job's
   :class:`JobFinish`: its lease released, its counts added to the fleet's metrics and its
   message acknowledged (:class:`StoredAck`), so a copy arriving at any moment finds the lease or
   the result;
4. **reap** (:data:`EXPIRED_LEASES`, :data:`REAPED`): a lease whose key expired with its owner
   dead is given back to its queue by any worker's reaper, which counts the death; so is an
   orphan's, whose owner is alive but has not run the job for a while (the write that ended it
   was lost in a failover), with no death counted; **release**
   (:data:`RELEASE`) gives a lease up without a result (a dropped copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Attribute of a task's request that carries its :class:`JobFinish`.
FINISH_ATTR = "devicefleet_finish"

#: Lua functions the state-storing scripts share (:data:`TAKE`, :data:`STORE`):
#: ``finished(key)``, whether the meta stored under ``key`` is a finished state (SUCCESS, FAILURE,
#: REVOKED); ``store(key, value, expires)``, Celery's write of a state: SETEX (SET when
#: ``expires`` is 0) and a PUBLISH for the producers waiting on it.
LUA_STATE_FUNCTIONS = """
local status_of = function(key)
  local current = redis.call('get', key)
  if not current then return false end
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' then return meta.status end
  return false
end
local finished = function(key)
  local status = status_of(key)
  return status == 'SUCCESS' or status == 'FAILURE' or status == 'REVOKED'
end
local store = function(key, value, expires)
  if tonumber(expires) > 0 then
    redis.call('setex', key, expires, value)
  else
    redis.call('set', key, value)
  end
  redis.call('publish', key, value)
end
"""

#: Take a job: one round trip. KEYS: the job's result meta key ('' to skip that check), its lease
#: key, ``keys.LEASES``, ``keys.worker_deaths(task_id)``. ARGV: our lease value, TTL ms, task id,
#: the STARTED meta to store ('' for none), its expiry in seconds, the lease we expect to replace
#: ('' takes a free lease only; else the lease key's value or, when that key has expired, the
#: value recorded in ``keys.LEASES``), the dead owner of that lease to count ('' for none), the
#: job's ``max_attempts`` (0: no bound), how long the deaths are kept in seconds (0: for ever).
#: Returns ``{'finished'}`` (the result is stored: do not run), ``{'held', value}`` (another
#: lease is there), ``{'expired', value}`` (another lease is recorded, its key expired: its
#: owner is dead or late to renew), ``{'changed'}`` (another lease replaced the one we read; a
#: lease gone altogether, which a reaper gave back, is taken without counting the death again),
#: ``{'lost', {worker, ...}}`` (taken, but the job has taken its worker down ``max_attempts``
#: times: do not run it, end it) or ``{'ok'}`` (taken).
TAKE = LUA_STATE_FUNCTIONS + """
if KEYS[1] ~= '' and finished(KEYS[1]) then return {'finished'} end
local lease = redis.call('get', KEYS[2])
local dead = ARGV[7]
if ARGV[6] == '' then
  if lease then return {'held', lease} end
  local recorded = redis.call('hget', KEYS[3], ARGV[3])
  if recorded then return {'expired', recorded} end
else
  local current = lease or redis.call('hget', KEYS[3], ARGV[3])
  if current and current ~= ARGV[6] then return {'changed'} end
  -- Gone altogether: a reaper gave the dead owner's job back meanwhile and counted its death
  -- (this copy may be the one it gave back): the job is free, and the death counted once.
  if not current then dead = '' end
end
if dead ~= '' then
  redis.call('rpush', KEYS[4], dead)
  if tonumber(ARGV[9]) > 0 then redis.call('expire', KEYS[4], ARGV[9]) end
end
redis.call('set', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('hset', KEYS[3], ARGV[3], ARGV[1])
local bound = tonumber(ARGV[8])
if bound > 0 and redis.call('llen', KEYS[4]) >= bound then
  return {'lost', redis.call('lrange', KEYS[4], 0, -1)}
end
if ARGV[4] ~= '' then store(KEYS[1], ARGV[4], ARGV[5]) end
return {'ok'}
"""
#: KEYS: lease key, leases hash; ARGV: our value, TTL ms, task id, '1' to restore a lost lease.
#: Renew our lease (or restore it after a Redis restart lost it); leave another worker's alone.
RENEW = """
local v = redis.call('get', KEYS[1])
if v ~= false and v ~= ARGV[1] then return 0 end
if v == false and ARGV[4] ~= '1' then return 1 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('hset', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
#: KEYS: lease key, leases hash; ARGV: our value, task id. Delete only what is ours.
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end
if redis.call('hget', KEYS[2], ARGV[2]) == ARGV[1] then redis.call('hdel', KEYS[2], ARGV[2]) end
return 1
"""


#: Store a task's state unless a final one is stored; with a job's finish, release its lease,
#: count it and acknowledge its message. KEYS: the task's meta key, its lease key,
#: ``keys.LEASES``, the device's stats hash, ``keys.STATS_DEVICES``, the device's finished set,
#: kombu's unacked hash and its index. ARGV: the encoded meta, expiry in seconds (0: none), the
#: lease value ('' if none), the task id, the count as JSON ('' if none), the message's delivery
#: tag ('' if none), '1' when every finished state is final (a devicefleet job: SUCCESS, FAILURE,
#: REVOKED), '' when only SUCCESS is (Celery's own rule, for every other task). Returns 1 if
#: stored, 0 if a final state was there already (nothing stored or counted; the lease is
#: released and the message acknowledged all the same).
STORE = LUA_STATE_FUNCTIONS + """
local release = function()
  if ARGV[6] ~= '' then
    redis.call('zrem', KEYS[8], ARGV[6])
    redis.call('hdel', KEYS[7], ARGV[6])
  end
  if ARGV[3] == '' then return end
  if redis.call('get', KEYS[2]) == ARGV[3] then redis.call('del', KEYS[2]) end
  if redis.call('hget', KEYS[3], ARGV[4]) == ARGV[3] then redis.call('hdel', KEYS[3], ARGV[4]) end
end
if (ARGV[7] == '1' and finished(KEYS[1])) or (ARGV[7] ~= '1' and status_of(KEYS[1]) == 'SUCCESS') then
  release()
  return 0
end
store(KEYS[1], ARGV[1], ARGV[2])
release()
if ARGV[5] ~= '' then
  local count = cjson.decode(ARGV[5])
  redis.call('sadd', KEYS[5], count.device)
  redis.call('hincrby', KEYS[4], count.outcome, 1)
  for field, value in pairs(count.add) do redis.call('hincrbyfloat', KEYS[4], field, value) end
  for field, value in pairs(count.set) do redis.call('hset', KEYS[4], field, value) end
  redis.call('zadd', KEYS[6], count.finished, ARGV[4])
  redis.call('zremrangebyscore', KEYS[6], '-inf', count.keep_after)
end
return 1
"""


#: The leases left without their key (expired, or lost): KEYS[1] ``keys.LEASES``; ARGV[1] the
#: lease keys' prefix (``keys.lease("")``). Returns ``[task id, lease record, ...]``.
EXPIRED_LEASES = """
local out = {}
local all = redis.call('hgetall', KEYS[1])
for i = 1, #all, 2 do
  if redis.call('exists', ARGV[1] .. all[i]) == 0 then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
"""


#: The reaper gave back (or could not give back) a dead owner's job, or an orphan's (its owner
#: alive but no longer running it). KEYS: ``keys.LEASES``, ``keys.REAPER_STATS``,
#: ``keys.worker_deaths(task_id)``; ARGV: task id, the lease record read, the dead owner to count
#: ('' for an orphan: no death), how long the deaths are kept in seconds (0: for ever). Counts
#: the owner's death only if the lease is still the one read: a worker that took it over
#: meanwhile has counted it. Returns 1 if the lease record was removed.
REAPED = """
redis.call('hincrby', KEYS[2], 'restored', 1)
if ARGV[3] == '' then redis.call('hincrby', KEYS[2], 'orphans', 1) end
if redis.call('hget', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('hdel', KEYS[1], ARGV[1])
if ARGV[3] == '' then return 1 end
redis.call('rpush', KEYS[3], ARGV[3])
if tonumber(ARGV[4]) > 0 then redis.call('expire', KEYS[3], ARGV[4]) end
return 1
"""


@dataclass
class StoredAck:
    """A job's message, acknowledged by the script that stores the job's result: kombu's
    unacked hash and index (the channel's names) and the message's delivery tag. ``done`` is
    set once the script ran; the worker's request then skips kombu's own round trip."""

    unacked_key: str
    unacked_index_key: str
    delivery_tag: str
    done: bool = False


@dataclass
class JobFinish:
    """What a device worker asks the backend to do with a job's finished state, in the same
    script call that stores it (``setattr(task.request, FINISH_ATTR, finish)``).

    Attributes:
        lease: the job's lease value, released if it is still ours; ``None``: no lease.
        count: the job's counters for the fleet's metrics
            (:func:`tasks.worker.accounting.job_count`); ``None``: not counted.
        ack: the job's message, acknowledged in the same call; ``None``: Celery acknowledges it.
        on_stored: called once the script has run (the worker forgets the lease).
    """

    device: str
    lease: str | None = None
    count: dict[str, Any] | None = None
    ack: StoredAck | None = None
    on_stored: Callable[[], None] | None = None
