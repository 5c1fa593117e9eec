"""The Lua scripts of a job's life in Redis (:mod:`tasks.core.jobstate`, whose
:class:`~tasks.core.jobstate.JobState` is the one caller of each): what each reads, writes and returns.

The two scripts with many keys and arguments, :data:`TAKE` and :data:`STORE`, take them as typed
records (:class:`TakeKeys`, :class:`TakeArgs`, :class:`StoreKeys`, :class:`StoreArgs`): a
record's fields, in order, are the positions of its ``KEYS`` or ``ARGV``, a caller builds it by
field name and passes :meth:`ScriptParams.values`, and the script reads each by the same name
from one Lua table (``key.lease``, ``arg.ttl_ms``) that :meth:`ScriptParams.lua` declares from
the same fields: no call site and no line of Lua depends on a position written in a comment.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .caps import CAP_LUA
from .device_state import LUA_OUT_OF_SERVICE
from .fairshare import USAGE_LUA


@dataclass(frozen=True)
class ScriptParams:
    """A script's ``KEYS`` or ``ARGV`` as a record (a frozen dataclass): its fields, in order, are
    the positions."""

    def values(self) -> list[Any]:
        """The fields' values, in order: what the script call passes."""
        return [getattr(self, field.name) for field in fields(self)]

    @classmethod
    def lua(cls, table: str, array: str) -> str:
        """Lua: ``local <table> = {<field> = <array>[<position>], ...}``, the table the script
        reads each one from by name."""
        named = ", ".join(f"{field.name} = {array}[{n}]" for n, field in enumerate(fields(cls), 1))
        return f"local {table} = {{{named}}}\n"


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
local stamp_lease = function(value, token)
  return (string.gsub(value, '^{"token":null', '{"token":' .. token, 1))
end
local stamp_meta = function(value, token)
  return (string.gsub(value, '"result": {"token": null', '"result": {"token": ' .. token, 1))
end
"""


@dataclass(frozen=True)
class TakeKeys(ScriptParams):
    """:data:`TAKE`'s ``KEYS`` (each the :mod:`tasks.core.keys` key of its name, as
    :meth:`tasks.core.jobstate.JobState.take` builds them; '' skips what reads it)."""

    #: The job's result meta key.
    meta: str
    lease: str
    leases: str
    deaths: str
    fence: str
    #: The owners that fenced themselves (no death).
    fenced: str
    caps: str
    cap_audit: str
    device_state: str


@dataclass(frozen=True)
class TakeArgs(ScriptParams):
    """:data:`TAKE`'s ``ARGV`` (what they mean: :meth:`tasks.core.jobstate.JobState.take`)."""

    #: Our lease value (a :class:`~tasks.core.records.LeaseRecord`, its token unstamped), and the
    #: same record with ``borrowed`` true: the one stored when the grant is borrowed.
    value: str
    borrowed_value: str
    ttl_ms: int
    task_id: str
    #: The STARTED meta to store ('' for none).
    started: str | bytes
    started_expires_s: int
    replace: str
    dead: str
    max_attempts: int
    #: How long the job's deaths and its token are kept in seconds (0: for ever).
    keep_s: int
    #: The job's user ('' for none: no cap applies) and the lease's device (whose kind a cap
    #: counts).
    user: str
    device: str
    lease_prefix: str
    audit_keep: int
    service_device: str


#: Take a job: one round trip (KEYS :class:`TakeKeys`, ARGV :class:`TakeArgs`). Taking INCRs the
#: job's fencing token and stamps it into our lease value and the STARTED meta (their ``"token"``
#: left ``null`` at a known place: :data:`UNSTAMPED_LEASE`, :data:`UNSTAMPED_META`); a dead owner
#: that reported it fenced itself (in ``keys.fenced``) is no death. Returns
#: ``{status, ...}``, a status of :class:`~tasks.core.jobstate.Took`: after ``'held'`` and
#: ``'expired'`` the lease found, after ``'capped'`` and ``'out'`` why (nothing written), after
#: ``'lost'`` the workers it took down; ``'ok'`` and ``'lost'`` end with the token and 1 when the
#: grant is borrowed over a cap (:mod:`tasks.core.caps`: each grant to a capped user or team is
#: appended to the audit list).
TAKE = LUA_STATE_FUNCTIONS + LUA_OUT_OF_SERVICE + CAP_LUA + TakeKeys.lua("key", "KEYS") + (
    TakeArgs.lua("arg", "ARGV") + """
if key.meta ~= '' and finished(key.meta) then return {'finished'} end
local out = out_of_service(key.device_state, arg.service_device)
if out then return {'out', out} end
local lease = redis.call('get', key.lease)
local dead = arg.dead
if arg.replace == '' then
  if lease then return {'held', lease} end
  local recorded = redis.call('hget', key.leases, arg.task_id)
  if recorded then return {'expired', recorded} end
else
  local current = lease or redis.call('hget', key.leases, arg.task_id)
  if current and current ~= arg.replace then return {'changed'} end
  -- Gone altogether: a reaper gave the dead owner's job back meanwhile and counted its death
  -- (this copy may be the one it gave back): the job is free, and the death counted once.
  if not current then dead = '' end
end
local cap_kind = kind_of(arg.device)
local rules = cap_rules(key.caps, arg.user, cap_kind)
cap_count(rules, key.leases, arg.lease_prefix, cap_kind, arg.task_id)
local refused, borrowed = cap_refused(rules, cap_kind)
if refused then return {'capped', refused} end
if dead ~= '' and redis.call('sismember', key.fenced, dead) == 0 then
  redis.call('rpush', key.deaths, dead)
  if tonumber(arg.keep_s) > 0 then redis.call('expire', key.deaths, arg.keep_s) end
end
local token = redis.call('incr', key.fence)
if tonumber(arg.keep_s) > 0 then redis.call('expire', key.fence, arg.keep_s) end
local value = stamp_lease(borrowed and arg.borrowed_value or arg.value, token)
redis.call('set', key.lease, value, 'PX', arg.ttl_ms)
redis.call('hset', key.leases, arg.task_id, value)
cap_audit(rules, key.cap_audit, arg.audit_keep, arg.task_id, arg.user, cap_kind, arg.device, borrowed)
local lent = borrowed and 1 or 0
local bound = tonumber(arg.max_attempts)
if bound > 0 and redis.call('llen', key.deaths) >= bound then
  return {'lost', redis.call('lrange', key.deaths, 0, -1), token, lent}
end
if arg.started ~= '' then store(key.meta, stamp_meta(arg.started, token), arg.started_expires_s) end
return {'ok', token, lent}
""")

#: KEYS: lease key, leases hash, ``keys.fence(task_id)``; ARGV: our value, TTL ms, task id, '1'
#: to restore a lost lease, our token (:meth:`~tasks.core.jobstate.JobState.renew`).
RENEW = """
if tonumber(redis.call('get', KEYS[3]) or 0) > tonumber(ARGV[5]) then return 0 end
local v = redis.call('get', KEYS[1])
if v ~= false and v ~= ARGV[1] then return 0 end
if v == false and ARGV[4] ~= '1' then return 1 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('hset', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
#: KEYS: lease key, leases hash, ``keys.fence(task_id)``; ARGV: our value, task id, our token
#: (:meth:`~tasks.core.jobstate.JobState.release`).
RELEASE = """
if tonumber(redis.call('get', KEYS[3]) or 0) > tonumber(ARGV[3]) then return 0 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end
if redis.call('hget', KEYS[2], ARGV[2]) == ARGV[1] then redis.call('hdel', KEYS[2], ARGV[2]) end
return 1
"""


@dataclass(frozen=True)
class StoreKeys(ScriptParams):
    """:data:`STORE`'s ``KEYS`` (each the :mod:`tasks.core.keys` key of its name, as
    :meth:`tasks.core.jobstate.JobState.finish` builds them)."""

    meta: str
    lease: str
    leases: str
    stats: str
    stats_devices: str
    finished: str
    #: kombu's unacked hash and its index ('' for no message to acknowledge).
    unacked: str
    unacked_index: str
    fence: str
    #: The job's usage (:data:`tasks.core.fairshare.USAGE_LUA`).
    usage: str
    user_seconds: str
    #: Emptied by a job ended ok.
    fast_failures: str
    #: Of the shared queue the job came from ('' for none): where its jobs end ok, by device.
    queue_ok: str


@dataclass(frozen=True)
class StoreArgs(ScriptParams):
    """:data:`STORE`'s ``ARGV``."""

    #: The encoded meta, its expiry in seconds (0: none).
    meta: str | bytes
    expires_s: int
    #: The lease value to release ('' if none).
    lease: str
    task_id: str
    #: The job's count ('' if none: :meth:`~tasks.core.jobcount.JobCount.script_arg`, whose fields
    #: are :data:`tasks.core.jobcount.SCRIPT_FIELDS`); the message's delivery tag ('' if none).
    count: str
    delivery_tag: str
    #: '1' when every finished state is final (a devicefleet job: SUCCESS, FAILURE, REVOKED), ''
    #: when only SUCCESS is (Celery's own rule, for every other task).
    final: str
    #: The attempt's fencing token ('' for none).
    token: int | str
    #: :data:`~tasks.core.defaults.BLACKHOLE_WINDOW_S`, how long ``queue_ok`` is kept.
    window_s: int


#: Store a task's state unless a final one is stored; with a job's end
#: (:class:`~tasks.core.jobstate.JobEnd`), release its lease, count it and acknowledge its
#: message (KEYS :class:`StoreKeys`, ARGV :class:`StoreArgs`). Returns 1, 0 or -1:
#: :class:`~tasks.core.jobstate.Stored` (-1 writes the device's ``writes_refused`` count).
STORE = LUA_STATE_FUNCTIONS + USAGE_LUA + StoreKeys.lua("key", "KEYS") + StoreArgs.lua("arg", "ARGV") + """
local release = function()
  if arg.delivery_tag ~= '' then
    redis.call('zrem', key.unacked_index, arg.delivery_tag)
    redis.call('hdel', key.unacked, arg.delivery_tag)
  end
  if arg.lease == '' then return end
  if redis.call('get', key.lease) == arg.lease then redis.call('del', key.lease) end
  if redis.call('hget', key.leases, arg.task_id) == arg.lease then redis.call('hdel', key.leases, arg.task_id) end
end
if arg.token ~= '' and tonumber(redis.call('get', key.fence) or 0) > tonumber(arg.token) then
  if arg.count ~= '' then
    redis.call('sadd', key.stats_devices, cjson.decode(arg.count).device)
    redis.call('hincrby', key.stats, 'writes_refused', 1)
  end
  return -1
end
if (arg.final == '1' and finished(key.meta)) or (arg.final ~= '1' and status_of(key.meta) == 'SUCCESS') then
  release()
  return 0
end
store(key.meta, arg.meta, arg.expires_s)
release()
if arg.count ~= '' then
  local count = cjson.decode(arg.count)
  redis.call('sadd', key.stats_devices, count.device)
  redis.call('hincrby', key.stats, count.outcome, 1)
  for field, value in pairs(count.add) do redis.call('hincrbyfloat', key.stats, field, value) end
  for field, value in pairs(count.set) do redis.call('hset', key.stats, field, value) end
  redis.call('zadd', key.finished, count.finished, arg.task_id)
  redis.call('zremrangebyscore', key.finished, '-inf', count.keep_after)
  add_usage(key.usage, key.user_seconds, count.share, count.wait)
  if count.outcome == 'jobs_ok' then
    -- A black hole's evidence (tasks.core.device_state.FAILED_FAST): the device ends jobs ok, so
    -- it is none; and, for a shared queue's job, it is where that queue's jobs succeed.
    redis.call('del', key.fast_failures)
    if key.queue_ok ~= '' then
      redis.call('hset', key.queue_ok, count.device, count.finished)
      redis.call('expire', key.queue_ok, arg.window_s)
    end
  end
end
return 1
"""


#: :meth:`~tasks.core.jobstate.JobState.progress` (its PROGRESS state unless a final state is
#: stored: a late report never overwrites the result). KEYS: the task's meta key,
#: ``keys.progress(task_id)``, ``keys.fence(task_id)``, the device's stats hash,
#: ``keys.STATS_DEVICES``; ARGV: the encoded meta, its expiry in seconds (0: none), the report
#: (JSON), its expiry in seconds, the attempt's fencing token, the device.
PROGRESS = LUA_STATE_FUNCTIONS + """
if tonumber(redis.call('get', KEYS[3]) or 0) > tonumber(ARGV[5]) then
  redis.call('sadd', KEYS[5], ARGV[6])
  redis.call('hincrby', KEYS[4], 'writes_refused', 1)
  return 0
end
if not finished(KEYS[1]) then store(KEYS[1], ARGV[1], ARGV[2]) end
redis.call('set', KEYS[2], ARGV[3], 'EX', ARGV[4])
return 1
"""


#: The leases left without their key (expired, or lost): KEYS[1] ``keys.LEASES``; ARGV[1] the
#: lease keys' prefix (``keys.lease("")``). Returns ``[task id, lease record, ...]``. With KEYS[2]
#: ``keys.REAPER_TURN``, ARGV[2] a reaper's token and ARGV[3] its interval (ms), first its turn:
#: another reaper's, false and no scan (one ``GET``); else its own for that long from now.
EXPIRED_LEASES = """
if KEYS[2] then
  local holder = redis.call('get', KEYS[2])
  if holder and holder ~= ARGV[2] then return false end
  redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
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


#: :meth:`~tasks.core.jobstate.JobState.reaped`. KEYS: ``keys.LEASES``, ``keys.REAPER_STATS``,
#: ``keys.worker_deaths(task_id)``, ``keys.fenced(task_id)``; ARGV: task id, the lease record
#: read, the dead owner, how long the deaths are kept. A lease no longer the one read was taken
#: over by a worker that counted the death; an owner that reported it fenced itself was cut
#: off, not dead: no death either.
REAPED = """
redis.call('hincrby', KEYS[2], 'restored', 1)
if ARGV[3] == '' then redis.call('hincrby', KEYS[2], 'orphans', 1) end
if redis.call('hget', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('hdel', KEYS[1], ARGV[1])
if ARGV[3] == '' or redis.call('sismember', KEYS[4], ARGV[3]) == 1 then return 1 end
redis.call('rpush', KEYS[3], ARGV[3])
if tonumber(ARGV[4]) > 0 then redis.call('expire', KEYS[3], ARGV[4]) end
return 1
"""

#: :meth:`~tasks.core.jobstate.JobState.fenced`. KEYS: ``keys.fenced(task_id)``,
#: ``keys.worker_deaths(task_id)``, ``keys.REAPER_STATS``, the device's stats hash,
#: ``keys.STATS_DEVICES``; ARGV: the worker's death note, how long it is kept, the device (its
#: ``jobs_fenced``). The note recorded, a reaper or a take later counts no death for it.
FENCED = """
redis.call('sadd', KEYS[1], ARGV[1])
if tonumber(ARGV[2]) > 0 then redis.call('expire', KEYS[1], ARGV[2]) end
redis.call('hincrby', KEYS[3], 'fenced', 1)
redis.call('sadd', KEYS[5], ARGV[3])
redis.call('hincrby', KEYS[4], 'jobs_fenced', 1)
return redis.call('lrem', KEYS[2], 0, ARGV[1])
"""

#: Where a lease value (a :class:`~tasks.core.records.LeaseRecord`, its first field) and a
#: STARTED meta (its result's first field, :func:`tasks.worker.lease.started_meta`) leave the
#: fencing token for the take script to stamp: a fixed place, which no user value can take.
UNSTAMPED_LEASE = '{"token":null'
UNSTAMPED_META = '"result": {"token": null'

