"""A job's life in Redis, in one place: every script that takes, renews, finishes, releases and
reaps a job's lease, the Python side that drives them (:class:`JobState`), and the records they
are handed and return.

Each step is one script call through :class:`JobState`, which nothing else calls scripts for:
the device worker's lease keeper and reaper (:mod:`tasks.worker.lease`, :mod:`tasks.worker.reaper`:
the threads, and what to do with each reply) and the result backend's store (:class:`tasks.core.backend.FleetBackend`,
through which every Celery path of storing a state goes). The record a job's lease holds is
:class:`tasks.core.records.LeaseRecord`; its keys are in :mod:`tasks.core.keys`.

A job's life, one script call a step:

1. **take** (:meth:`JobState.take`, :data:`TAKE`): unless its result is stored, the worker takes
   the job's lease ``keys.lease(task_id)`` (a TTL key, and ``{task id: lease}`` in
   ``keys.LEASES``) and stores its STARTED state. A lease held by a live owner refuses the copy
   (the job never runs twice at once); a dead owner's lease is taken over and its death counted
   (``keys.worker_deaths``); a job with ``max_attempts`` deaths is taken but not run
   (``lost``). What it takes is an :class:`Attempt`, the handle every later step of that run
   carries;
2. **renew** (:meth:`JobState.renew`, :data:`RENEW`): the worker's lease keeper, a third of the
   TTL apart, while the job's process lives;
3. **finish** (:meth:`JobState.finish`, :data:`STORE`): the result stored unless a finished one
   is there, with the job's :class:`JobEnd`: its attempt's lease released, its count
   (:class:`~tasks.core.jobcount.JobCount`) added to the fleet's metrics and its message
   acknowledged (:class:`MessageAck`), so a copy arriving at any moment finds the lease or the
   result;
4. **reap** (:meth:`JobState.expired`, :meth:`JobState.reaped`): a lease whose key expired with
   its owner dead is given back to its queue by any worker's reaper, which counts the death; so
   is an orphan's, whose owner is alive but has not run the job for a while (the write that
   ended it was lost in a failover), with no death counted; **release**
   (:meth:`JobState.release`) gives a lease up without a result (a dropped copy, a retry).

The job's end crosses one seam it cannot avoid: a device worker builds it while the job's task
runs, but Celery's tracer stores the task's result afterwards, through the result backend, and
hands the backend nothing but the task's request. The end therefore rides on that request, in
one field (:data:`END_FIELD`), written by :func:`hand_over` and read by :func:`handover`, and
nowhere else. The request is the very object the tracer passes to the store and then to
``task_postrun``, so the end goes with the run that built it: a second copy of the same task
running in another thread of the process has a request of its own, and an end whose store
never comes (a worker going down) goes away with its request. (A registry keyed by task id,
the other way, would need cleaning up after every path and could hand one copy's end to
another's store.) The store records what it did on the same :class:`Handover`, where the lease
keeper reads it after the store (``task_postrun``: :meth:`tasks.worker.lease.LeaseKeeper.settle`).

Fencing: taking a lease INCRs the job's token (``keys.fence(task_id)``), a number that only
grows per job, stamped into the lease value and the STARTED state and carried by the
:class:`Attempt` (and so by every write of that attempt: its renewals, its release, its
:class:`JobEnd`). The scripts that store and release refuse a token older than the job's
current one: a worker that was cut off, whose job a newer attempt runs now, writes nothing (a
refused store is :attr:`Stored.FENCED`, which the keeper's settle sees); so does the script that
publishes its progress (:data:`PROGRESS`). A worker that stopped
its job itself, cut off (self-fencing, :mod:`tasks.worker.fence`), reports it
(:meth:`JobState.fenced`): the reaper and the take count no death for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from . import keys
from .caps import CAP_LUA
from .defaults import BLACKHOLE_WINDOW_S, CAP_AUDIT_KEEP
from .device_state import LUA_OUT_OF_SERVICE
from .fairshare import USAGE_LUA
from .jobcount import JobCount
from .records import LeaseRecord
from .transport import acked_in_redis

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

#: Take a job: one round trip. KEYS: the job's result meta key ('' to skip that check), its lease
#: key, ``keys.LEASES``, ``keys.worker_deaths(task_id)``. ARGV: our lease value, TTL ms, task id,
#: the STARTED meta to store ('' for none), its expiry in seconds, the lease we expect to replace
#: ('' takes a free lease only; else the lease key's value or, when that key has expired, the
#: value recorded in ``keys.LEASES``), the dead owner of that lease to count ('' for none), the
#: job's ``max_attempts`` (0: no bound), how long the deaths and the token are kept in seconds
#: (0: for ever). KEYS[5]: ``keys.fence(task_id)``, KEYS[6]: ``keys.fenced(task_id)``. Taking
#: INCRs the job's fencing token and stamps it into our lease value and the STARTED meta (their
#: ``"token"`` left ``null`` at a known place: :data:`UNSTAMPED_LEASE`, :data:`UNSTAMPED_META`);
#: a dead owner that reported it fenced itself (in ``keys.fenced``) is no death. The token comes back after ``'ok'`` and ``'lost'``. Returns ``{'finished'}`` (the result is stored: do not run), ``{'held', value}`` (another
#: lease is there), ``{'expired', value}`` (another lease is recorded, its key expired: its
#: owner is dead or late to renew), ``{'changed'}`` (another lease replaced the one we read; a
#: lease gone altogether, which a reaper gave back, is taken without counting the death again),
#: ``{'lost', {worker, ...}}`` (taken, but the job has taken its worker down ``max_attempts``
#: times: do not run it, end it) or ``{'ok'}`` (taken).
#:
#: Caps (:mod:`tasks.core.caps`): KEYS[7] ``keys.CAPS``, KEYS[8] ``keys.CAP_AUDIT``; ARGV[10]
#: the job's user ('' for none: no cap applies), ARGV[11] the device, ARGV[12] the lease keys'
#: prefix, ARGV[13] the audit entries kept. A job whose user (or team) holds its cap of the
#: device's kind, counted from the live leases, is refused: ``{'capped', reason}`` (nothing
#: written); over a cap that borrows it is taken as borrowed (its lease's ``borrowed`` true; the
#: reply's last element 1). Each grant to a capped user or team is appended to the audit list.
#: KEYS[9] ``keys.DEVICE_STATE`` and ARGV[14] the taker's device ('' for neither): a device out of
#: service takes nothing (:mod:`tasks.core.device_state`): ``{'out', state}``, nothing written.
TAKE = LUA_STATE_FUNCTIONS + LUA_OUT_OF_SERVICE + CAP_LUA + """
if KEYS[1] ~= '' and finished(KEYS[1]) then return {'finished'} end
local out = out_of_service(KEYS[9] or '', ARGV[14] or '')
if out then return {'out', out} end
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
local cap_kind = kind_of(ARGV[11])
local rules = cap_rules(KEYS[7], ARGV[10], cap_kind)
cap_count(rules, KEYS[3], ARGV[12], cap_kind, ARGV[3])
local refused, borrowed = cap_refused(rules, cap_kind)
if refused then return {'capped', refused} end
if dead ~= '' and redis.call('sismember', KEYS[6], dead) == 0 then
  redis.call('rpush', KEYS[4], dead)
  if tonumber(ARGV[9]) > 0 then redis.call('expire', KEYS[4], ARGV[9]) end
end
local token = redis.call('incr', KEYS[5])
if tonumber(ARGV[9]) > 0 then redis.call('expire', KEYS[5], ARGV[9]) end
local value = stamp_lease(ARGV[1], token)
if borrowed then value = (string.gsub(value, '"borrowed":false}$', '"borrowed":true}', 1)) end
redis.call('set', KEYS[2], value, 'PX', ARGV[2])
redis.call('hset', KEYS[3], ARGV[3], value)
cap_audit(rules, KEYS[8], ARGV[13], ARGV[3], ARGV[10], cap_kind, ARGV[11], borrowed)
local lent = borrowed and 1 or 0
local bound = tonumber(ARGV[8])
if bound > 0 and redis.call('llen', KEYS[4]) >= bound then
  return {'lost', redis.call('lrange', KEYS[4], 0, -1), token, lent}
end
if ARGV[4] ~= '' then store(KEYS[1], stamp_meta(ARGV[4], token), ARGV[5]) end
return {'ok', token, lent}
"""
#: KEYS: lease key, leases hash, ``keys.fence(task_id)``; ARGV: our value, TTL ms, task id, '1'
#: to restore a lost lease, our token. Renew our lease (or restore it after a Redis restart lost
#: it); leave another worker's alone, and refuse (0) once a newer attempt has a token.
RENEW = """
if tonumber(redis.call('get', KEYS[3]) or 0) > tonumber(ARGV[5]) then return 0 end
local v = redis.call('get', KEYS[1])
if v ~= false and v ~= ARGV[1] then return 0 end
if v == false and ARGV[4] ~= '1' then return 1 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('hset', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
#: KEYS: lease key, leases hash, ``keys.fence(task_id)``; ARGV: our value, task id, our token.
#: Delete only what is ours; an older token than the job's is refused (returns 0).
RELEASE = """
if tonumber(redis.call('get', KEYS[3]) or 0) > tonumber(ARGV[3]) then return 0 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end
if redis.call('hget', KEYS[2], ARGV[2]) == ARGV[1] then redis.call('hdel', KEYS[2], ARGV[2]) end
return 1
"""


#: Store a task's state unless a final one is stored; with a job's end (:class:`JobEnd`), release
#: its lease, count it and acknowledge its message. KEYS: the task's meta key, its lease key,
#: ``keys.LEASES``, the device's stats hash, ``keys.STATS_DEVICES``, the device's finished set,
#: kombu's unacked hash and its index, ``keys.fence(task_id)``, ``keys.USAGE``,
#: ``keys.USER_SECONDS`` (the job's usage: :data:`tasks.core.fairshare.USAGE_LUA`; its wait goes
#: to the histogram key its count names). ARGV: the encoded meta, expiry in seconds (0: none), the
#: lease value ('' if none), the task id, the count ('' if none: :meth:`JobCount.script_arg`,
#: whose fields are :data:`tasks.core.jobcount.SCRIPT_FIELDS`), the message's delivery tag ('' if none), '1' when every finished state is final (a devicefleet job: SUCCESS, FAILURE,
#: REVOKED), '' when only SUCCESS is (Celery's own rule, for every other task), the attempt's
#: fencing token ('' for none), ARGV[9] :data:`~tasks.core.defaults.BLACKHOLE_WINDOW_S`; KEYS[12]
#: ``keys.fast_failures(device)`` (a job ended ok empties it), KEYS[13] ``keys.queue_ok(queue)`` of
#: the shared queue the job came from ('' for none: where that queue's jobs end ok, by device).
#: Returns 1 if stored, 0 if a final state was there already
#: (nothing stored or counted; the lease is released and the message acknowledged all the same),
#: -1 if the token is older than the job's (a newer attempt holds the job: nothing is written
#: but the device's ``writes_refused`` count).
STORE = LUA_STATE_FUNCTIONS + USAGE_LUA + """
local release = function()
  if ARGV[6] ~= '' then
    redis.call('zrem', KEYS[8], ARGV[6])
    redis.call('hdel', KEYS[7], ARGV[6])
  end
  if ARGV[3] == '' then return end
  if redis.call('get', KEYS[2]) == ARGV[3] then redis.call('del', KEYS[2]) end
  if redis.call('hget', KEYS[3], ARGV[4]) == ARGV[3] then redis.call('hdel', KEYS[3], ARGV[4]) end
end
if ARGV[8] ~= '' and tonumber(redis.call('get', KEYS[9]) or 0) > tonumber(ARGV[8]) then
  if ARGV[5] ~= '' then
    redis.call('sadd', KEYS[5], cjson.decode(ARGV[5]).device)
    redis.call('hincrby', KEYS[4], 'writes_refused', 1)
  end
  return -1
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
  add_usage(KEYS[10], KEYS[11], count.share, count.wait)
  if count.outcome == 'jobs_ok' then
    -- A black hole's evidence (FAILED_FAST): the device ends jobs ok, so it is none; and, for a
    -- shared queue's job, it is where that queue's jobs succeed.
    redis.call('del', KEYS[12])
    if KEYS[13] ~= '' then
      redis.call('hset', KEYS[13], count.device, count.finished)
      redis.call('expire', KEYS[13], ARGV[9])
    end
  end
end
return 1
"""

#: A job failed fast (within ``BLACKHOLE_FAST_S`` of run time) on a device: the fleet decides,
#: where it decides a job's end, whether the device is a black hole and what becomes of the job
#: (the rule and K: docs/guides/devices.md, :data:`~tasks.core.defaults.BLACKHOLE_K`). KEYS:
#: ``keys.fast_failures(device)``, ``keys.failed_on(task_id)``, ``keys.DEVICE_STATE``,
#: ``keys.queue_ok(queue)`` of the shared queue it came from (its kind's, ``fleet``, a sweep's),
#: ``keys.fast_failure_errors(device)``; ARGV: task id, device, its error (one line), K, the window
#: in seconds, now (epoch seconds), the prefix of ``keys.fast_failures``.
#:
#: - failed on two devices: the job's fault; it is evidence against neither (taken out of every
#:   device's window) -> ``{'store', ''}``;
#: - else it joins the device's window of different jobs failed fast; at K of them, while another
#:   device ended a job of the same queue ok since the first of them, and the device in service, it is
#:   quarantined (``keys.DEVICE_STATE``, ``by`` fleet) with the jobs and their errors as reason;
#: - the job: its first fast failure on this device -> ``{'again',
#:   reason}``: not stored, back to its queue, no attempt spent (another device runs it, or this
#:   one once more: a second failure here is stored); else ``{'store', reason}``. ``reason``: the
#:   quarantine's, when this failure made it ('' otherwise).
FAILED_FAST = """
local device, job, now, window = ARGV[2], ARGV[1], tonumber(ARGV[6]), tonumber(ARGV[5])
local before = redis.call('hexists', KEYS[2], device) == 1
redis.call('hset', KEYS[2], device, ARGV[3])
redis.call('expire', KEYS[2], window)
local devices = redis.call('hkeys', KEYS[2])
if #devices >= 2 then
  for _, other in ipairs(devices) do redis.call('zrem', ARGV[7] .. other, job) end
  return {'store', ''}
end
redis.call('zadd', KEYS[1], now, job)
redis.call('zremrangebyscore', KEYS[1], '-inf', now - window)
redis.call('expire', KEYS[1], window)
redis.call('hset', KEYS[5], job, ARGV[3])
redis.call('expire', KEYS[5], window)
local reason = ''
local jobs = redis.call('zrange', KEYS[1], 0, -1, 'withscores')
if #jobs / 2 >= tonumber(ARGV[4]) and redis.call('hexists', KEYS[3], device) == 0 then
  local first = tonumber(jobs[2])
  local elsewhere = nil
  local last_ok = redis.call('hgetall', KEYS[4])  -- where the same queue's jobs ended ok lately
  for i = 1, #last_ok, 2 do
    if last_ok[i] ~= device and tonumber(last_ok[i + 1]) >= first then elsewhere = last_ok[i] end
  end
  if elsewhere then
    local evidence = {}
    for i = 1, #jobs, 2 do
      evidence[#evidence + 1] = jobs[i] .. ' (' .. (redis.call('hget', KEYS[5], jobs[i]) or '?') .. ')'
    end
    reason = 'black hole: ' .. (#jobs / 2) .. ' different jobs failed fast here while ' .. elsewhere ..
      ' ended jobs ok: ' .. table.concat(evidence, '; ')
    redis.call('hset', KEYS[3], device, cjson.encode({device = device, state = 'quarantined', reason = reason,
      since = now, by = 'fleet', hardware = false, now = false}))
  end
end
if not before then return {'again', reason} end
return {'store', reason}
"""


#: Publish a running job's progress report for its attempt: its PROGRESS state (unless a final
#: state is stored: a late report never overwrites the result) and its report under
#: ``keys.progress(task_id)``. KEYS: the task's meta key, ``keys.progress(task_id)``,
#: ``keys.fence(task_id)``, the device's stats hash, ``keys.STATS_DEVICES``; ARGV: the encoded
#: meta, its expiry in seconds (0: none), the report (JSON), its expiry in seconds, the attempt's
#: fencing token, the device. Returns 1, or 0 if the token is older than the job's (a newer
#: attempt runs it: nothing written but the device's ``writes_refused`` count).
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
#: meanwhile has counted it; nor one the owner reported it fenced itself (KEYS[4],
#: ``keys.fenced(task_id)``): that was a partition, not a crash. Returns 1 if the lease record
#: was removed.
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

#: A worker that stopped a job itself, cut off from Redis (self-fencing), reports it once it
#: reaches Redis again: its loss of the job was a partition, not a crash. KEYS:
#: ``keys.fenced(task_id)``, ``keys.worker_deaths(task_id)``, ``keys.REAPER_STATS``, the
#: device's stats hash, ``keys.STATS_DEVICES``; ARGV: the worker's death note (``"<worker> pid
#: <pid>"``), how long it is kept in seconds (0: for ever), the device (its ``jobs_fenced``).
#: Records the note (a reaper or a take later counts no death for it) and takes back a death a
#: reaper counted for it meanwhile. Returns how many deaths it took back.
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


def stamp_lease(value: str, token: int) -> str:
    """Lease value ``value`` as the take script stores it with fencing token ``token``."""
    return f'{{"token":{token}{value.removeprefix(UNSTAMPED_LEASE)}' if value.startswith(UNSTAMPED_LEASE) else value


def _token(value: str | bytes | None) -> int | None:
    """The fencing token a lease value carries (its first field, stamped by the take script)."""
    if value is None:
        return None
    text = bytes_to_str(value)
    head, _, _ = text.removeprefix('{"token":').partition(",")
    try:
        return int(head)
    except ValueError:  # unstamped or not a lease: no attempt holds it
        return None


@dataclass(frozen=True)
class Attempt:
    """One run of a job under its lease: the handle :meth:`JobState.take` returns, and what
    renewing, releasing and storing the job's end take."""

    task_id: str
    #: The lease key's value (its :class:`~tasks.core.records.LeaseRecord` as JSON, with its
    #: token): a script renews, releases or deletes a lease only while it is still this one.
    lease: str
    #: The attempt's fencing token: issued by the take, it only grows per job; the scripts that
    #: store, release or publish refuse a token older than the job's current one.
    token: int = 0
    #: Taken over its user's cap, as borrowed work (:mod:`tasks.core.caps`): preemptible by any
    #: work that waits for its device.
    borrowed: bool = False


class Took(str, Enum):
    """What the take script found (:data:`TAKE`)."""

    #: Taken: run the job.
    OK = "ok"
    #: Taken, but the job has taken its worker down ``max_attempts`` times: do not run it.
    LOST = "lost"
    #: Its result is stored: do not run it.
    FINISHED = "finished"
    #: Another lease is there.
    HELD = "held"
    #: Another lease is recorded, its key expired (its owner dead, or late to renew).
    EXPIRED = "expired"
    #: The lease we meant to replace was replaced by another meanwhile.
    CHANGED = "changed"
    #: The taker's device is out of service (drained, quarantined, suspect): nothing taken.
    OUT = "out"
    #: Its user (or team) holds its cap of the device's kind: not taken (:mod:`tasks.core.caps`).
    CAPPED = "capped"


@dataclass(frozen=True)
class TakeReply:
    """The take script's reply: with :attr:`Took.OK` and :attr:`Took.LOST` the :class:`Attempt`
    now held, with :attr:`Took.LOST` the workers the job took down (oldest first), with
    :attr:`Took.HELD` and :attr:`Took.EXPIRED` the lease record found there."""

    status: Took
    attempt: Attempt | None = None
    holder: str | None = None
    lost_to: tuple[str, ...] = ()
    #: With :attr:`Took.OUT`: the device's state.
    out: str = ""
    #: With :attr:`Took.CAPPED`, why: ``alice: 1/1 cpu (cap), borrowing off``.
    capped: str | None = None
    #: With :attr:`Took.OK` and :attr:`Took.LOST`: taken over its user's cap, as borrowed work.
    borrowed: bool = False


@dataclass(frozen=True)
class StateMeta:
    """A task's state as Celery stores it: its meta key, the encoded meta, and how long it is
    kept in seconds (0: for ever)."""

    key: str
    value: str | bytes
    expires_s: int


@dataclass(frozen=True)
class MessageAck:
    """A job's message, acknowledged by the script that stores the job's end: kombu's unacked
    hash and index (its channel's names, :func:`tasks.core.transport.stored_ack_keys`) and the
    message's delivery tag. The channel's acknowledgement that follows is then only kombu's
    bookkeeping (:func:`tasks.core.transport.acked_in_redis`)."""

    unacked_key: str
    unacked_index_key: str
    delivery_tag: str


@dataclass(frozen=True)
class JobEnd:
    """What goes with a job's finished state, in the one script call that stores it: built by
    one builder (:func:`tasks.worker.accounting.job_end`) on every path a job ends by (it ran,
    failed, crashed or was cancelled; it was refused: invalid options, lost; it is unknown).

    Attributes:
        attempt: the lease to release if it is still this attempt's; ``None``: no lease.
        count: the job's figures for the fleet's metrics; ``None``: not counted.
        ack: the job's message, acknowledged in the same call; ``None``: Celery acknowledges it.
    """

    attempt: Attempt | None = None
    count: JobCount | None = None
    ack: MessageAck | None = None
    #: The shared queue the job came from ('' for its device's own, or none): the store records
    #: where that queue's jobs end ok (a black hole's evidence: :data:`FAILED_FAST`).
    shared_queue: str = ""


@dataclass(frozen=True)
class FastFailure:
    """What :data:`FAILED_FAST` decided: the job goes back to its queue (``again``) or its failure
    is stored; ``quarantined``: the reason of the device's quarantine this failure made ('' none)."""

    again: bool
    quarantined: str = ""


class Stored(str, Enum):
    """What the store script did (:data:`STORE`)."""

    #: The state is stored; with a :class:`JobEnd`, its lease released, its count added and
    #: its message acknowledged.
    STORED = "stored"
    #: A final state was there: nothing stored or counted; the end's lease released and its
    #: message acknowledged all the same.
    FINAL_THERE = "final state there"
    #: Refused: the end's attempt has an older token than the job's (a newer attempt holds it,
    #: this one was cut off): nothing written.
    FENCED = "fenced"


# -- the seam: a job's end, from the worker's run to the result backend's store ------------------

#: The one field of a Celery task request that carries a job's :class:`Handover` (see the
#: module's docstring); written by :func:`hand_over`, read by :func:`handover` only.
END_FIELD = "devicefleet_end"


@dataclass
class Handover:
    """A job's end handed to the store of its finished state, and what that store did
    (``None`` until it ran: it failed, or has not come yet) and whether a replica had it."""

    end: JobEnd
    stored: Stored | None = None
    #: Whether a replica had the store (:class:`tasks.core.sentinel.Replication`; always with
    #: none asked for): False, it is not done, and the job may run again after a failover.
    confirmed: bool = True


def hand_over(request: Any, end: JobEnd) -> Handover:
    """Hand ``end`` to the store of the finished state of the task whose request is
    ``request`` (the tracer's, or any request a store is then called with)."""
    handed = Handover(end)
    setattr(request, END_FIELD, handed)
    return handed


def handover(request: Any) -> Handover | None:
    """The job's end handed with ``request`` (:func:`hand_over`), if any."""
    handed = getattr(request, END_FIELD, None)
    return handed if isinstance(handed, Handover) else None


# -- the interface ---------------------------------------------------------------------------------


class JobState:
    """A job's life in Redis through ``client``: each method is one script call (one round trip),
    called by hash (EVALSHA: each script's text is sent once per connection pool)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._take = client.register_script(TAKE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)
        self._store = client.register_script(STORE)
        self._expired = client.register_script(EXPIRED_LEASES)
        self._reaped = client.register_script(REAPED)
        self._fenced = client.register_script(FENCED)
        self._progress = client.register_script(PROGRESS)
        self._failed_fast = client.register_script(FAILED_FAST)

    def take(self, record: LeaseRecord, ttl_ms: int, *, started: StateMeta | None = None, replace: str = "",
             dead: str = "", max_attempts: int = 0, keep_s: int = 0, device: str = "") -> TakeReply:
        """Take the lease of ``record.task_id`` as ``record`` for ``ttl_ms`` and, with
        ``started``, store the job's STARTED state, unless the job's result is stored.

        ``replace``: the lease expected there ('' takes a free lease only; else the lease key's
        value or, when that key has expired, the value recorded in ``keys.LEASES``); ``dead``:
        the dead owner of that lease, whose death is counted (kept ``keep_s`` seconds, 0: for
        ever); ``max_attempts``: the deaths after which the job is taken but not run (0: no
        bound); ``device``: the taker's, refused while out of service ('' for no check). See :data:`TAKE`."""
        task_id = record.task_id
        value = record.to_json()
        reply = self._take(
            keys=[started.key if started else "", keys.lease(task_id), keys.LEASES, keys.worker_deaths(task_id),
                  keys.fence(task_id), keys.fenced(task_id), keys.CAPS, keys.CAP_AUDIT,
                  keys.DEVICE_STATE if device else ""],
            args=[value, ttl_ms, task_id, started.value if started else "", started.expires_s if started else 0,
                  replace, dead, max_attempts, keep_s, record.user or "", record.device, keys.lease(""),
                  CAP_AUDIT_KEEP, device],
        )
        status = Took(bytes_to_str(reply[0]))
        if status is Took.OUT:
            return TakeReply(status, out=bytes_to_str(reply[1]))
        if status in (Took.HELD, Took.EXPIRED):
            return TakeReply(status, holder=bytes_to_str(reply[1]))
        if status is Took.CAPPED:
            return TakeReply(status, capped=bytes_to_str(reply[1]))
        if status in (Took.OK, Took.LOST):
            token, borrowed = int(reply[-2]), bool(int(reply[-1]))
            held = record.model_copy(update={"borrowed": True}).to_json() if borrowed else value
            return TakeReply(status, attempt=Attempt(task_id, stamp_lease(held, token), token, borrowed),
                             lost_to=tuple(bytes_to_str(name) for name in reply[1]) if status is Took.LOST else (),
                             borrowed=borrowed)
        return TakeReply(status)

    def renew(self, attempt: Attempt, ttl_ms: int, *, restore: bool) -> bool:
        """Renew ``attempt``'s lease for ``ttl_ms`` (and, with ``restore``, write it again if a
        Redis restart lost it); False if another worker's lease is there (left alone) or a newer
        attempt has a token."""
        return bool(self._renew(keys=[keys.lease(attempt.task_id), keys.LEASES, keys.fence(attempt.task_id)],
                                args=[attempt.lease, ttl_ms, attempt.task_id, "1" if restore else "", attempt.token]))

    def release(self, attempt: Attempt) -> bool:
        """Give ``attempt``'s lease up without a result, if it is still this attempt's (a worker
        that was cut off must not delete its successor's). False if its token is older than
        the job's (refused)."""
        return bool(self._release(keys=[keys.lease(attempt.task_id), keys.LEASES, keys.fence(attempt.task_id)],
                                  args=[attempt.lease, attempt.task_id, attempt.token]))

    def finish(self, task_id: str, meta: StateMeta, end: JobEnd | None, *, final: bool) -> Stored:
        """Store task ``task_id``'s state ``meta`` unless a final one is stored and, with a job's
        ``end``, release its lease, count it and acknowledge its message (:data:`STORE`).
        ``final``: every finished state is final (a devicefleet job), else only SUCCESS is
        (Celery's rule). Idempotent: run again (after a failover), it finds its state stored."""
        end = end or JobEnd()
        count, ack = end.count, end.ack
        device = count.device if count is not None else ""
        stored = self._store(
            keys=[meta.key, keys.lease(task_id), keys.LEASES, keys.stats(device), keys.STATS_DEVICES,
                  keys.finished(device), ack.unacked_key if ack else "", ack.unacked_index_key if ack else "",
                  keys.fence(task_id), keys.USAGE, keys.USER_SECONDS, keys.fast_failures(device),
                  keys.queue_ok(end.shared_queue) if end.shared_queue else ""],
            args=[meta.value, meta.expires_s, end.attempt.lease if end.attempt else "", task_id,
                  count.script_arg() if count is not None else "", ack.delivery_tag if ack else "",
                  "1" if final else "", end.attempt.token if end.attempt else "", BLACKHOLE_WINDOW_S],
        )
        if int(stored) < 0:
            return Stored.FENCED
        if ack is not None:
            acked_in_redis(ack.delivery_tag)
        return Stored.STORED if int(stored) else Stored.FINAL_THERE

    def failed_fast(self, task_id: str, device: str, error: str, *, queue: str, now: float, k: int,
                    window_s: int) -> FastFailure:
        """Job ``task_id`` of shared queue ``queue`` failed fast on ``device`` with ``error``
        (:data:`FAILED_FAST`): whether its failure is stored or it goes back to its queue, and
        the quarantine of the device this failure made, if it did."""
        reply = self._failed_fast(
            keys=[keys.fast_failures(device), keys.failed_on(task_id), keys.DEVICE_STATE, keys.queue_ok(queue),
                  keys.fast_failure_errors(device)],
            args=[task_id, device, error, k, window_s, now, keys.FAST_FAILURES_PREFIX])
        return FastFailure(again=bytes_to_str(reply[0]) == "again", quarantined=bytes_to_str(reply[1]))

    def lease_tokens(self, task_ids: list[str]) -> list[int | None]:
        """The fencing token of each job's lease now (``None``: no lease: it expired, was
        released or reaped), one ``MGET``: what a distributed job's ranks read of each other's
        (:class:`tasks.worker.gang.GangWatch`)."""
        if not task_ids:
            return []
        raw = self.client.mget([keys.lease(task_id) for task_id in task_ids])
        return [_token(value) for value in raw]

    def progress(self, attempt: Attempt, meta: StateMeta, report: str, expires_s: int, device: str) -> bool:
        """Publish ``attempt``'s progress ``report`` (JSON) and its PROGRESS state ``meta``
        (:data:`PROGRESS`); False if a newer attempt holds the job (refused, counted)."""
        task_id = attempt.task_id
        return bool(self._progress(
            keys=[meta.key, keys.progress(task_id), keys.fence(task_id), keys.stats(device), keys.STATS_DEVICES],
            args=[meta.value, meta.expires_s, report, expires_s, attempt.token, device]))

    def expired(self) -> dict[str, str]:
        """``{task id: lease record}`` of the leases whose key is gone: the reaper's candidates,
        whose owner may still be alive (late to renew)."""
        reply = self._expired(keys=[keys.LEASES], args=[keys.lease("")])
        return {bytes_to_str(task_id): bytes_to_str(raw) for task_id, raw in zip(reply[::2], reply[1::2], strict=True)}

    def reaped(self, task_id: str, raw: str, dead: str, keep_s: int) -> bool:
        """The reaper gave back job ``task_id`` whose lease record read ``raw``: remove the
        record if it is still that one and count ``dead``'s death ('' for an orphan: none),
        kept ``keep_s`` seconds (0: for ever). True if the record was removed."""
        return bool(self._reaped(keys=[keys.LEASES, keys.REAPER_STATS, keys.worker_deaths(task_id),
                                       keys.fenced(task_id)],
                                 args=[task_id, raw, dead, keep_s]))

    def fenced(self, task_id: str, device: str, note: str, keep_s: int) -> int:
        """Report that ``device``'s worker named ``note`` (``"<worker> pid <pid>"``) stopped job
        ``task_id`` itself, cut off from Redis (:data:`FENCED`): no death is counted for it, and
        one a reaper counted meanwhile is taken back. Returns how many were taken back."""
        return int(self._fenced(keys=[keys.fenced(task_id), keys.worker_deaths(task_id), keys.REAPER_STATS,
                                      keys.stats(device), keys.STATS_DEVICES],
                                args=[note, keep_s, device]))
