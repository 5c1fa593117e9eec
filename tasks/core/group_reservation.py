"""A device group's reservation in Redis: its claims (:mod:`tasks.core.claims`) and holds.

The protocol as a whole is in :mod:`tasks.worker.group`; this module holds the steps its
producer (:func:`reserve_at_send`, :func:`release_unclaimed`), its leader (:func:`reserve`,
:func:`start`, :func:`release`) and its devices' keepers (:func:`move_hold`) take on the same
keys, each one script (one round trip, atomic).

A leader waits on its wake list (:func:`tasks.core.keys.group_wake`) for
:data:`~tasks.core.defaults.GROUP_POLL_S` at most: a fractional ``BLPOP`` timeout, which Redis
takes from 6.0 on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from . import claims, keys
from .defaults import GROUP_NUDGE_TTL_MS
from .priority import DEFAULT_LEVEL, Level, level_offset, precedence

#: KEYS: CLAIM_SEQ, the attempt's hash, its alive key, then each device's claims and nudge (the
#: leader's first). ARGV: attempt id, ttl ms, group id, leader, devices (comma list), since,
#: waiting_for, nudge ttl ms, level, the level's offset (:func:`tasks.core.priority.level_offset`).
#: Claims each device but the leader's as ``group:<attempt>`` and the leader's as
#: ``sent:<attempt>`` (:mod:`tasks.core.claims`), scored with the group's precedence (its seq plus
#: the offset). Returns the group's seq.
_SEND = """
local seq = redis.call('incr', KEYS[1])
local score = string.format('%.0f', seq + tonumber(ARGV[10]))
redis.call('hset', KEYS[2], 'group', ARGV[3], 'leader', ARGV[4], 'devices', ARGV[5], 'seq', seq,
           'level', ARGV[9], 'state', 'sent', 'waiting_for', ARGV[7], 'since', ARGV[6])
redis.call('pexpire', KEYS[2], ARGV[2])
redis.call('set', KEYS[3], 1, 'px', ARGV[2])
for i = 4, #KEYS, 2 do
  redis.call('zadd', KEYS[i], score, (i == 4 and 'sent:' or 'group:') .. ARGV[1])
  redis.call('rpush', KEYS[i + 1], 1)
  redis.call('pexpire', KEYS[i + 1], ARGV[8])
end
return seq
"""

#: KEYS: the sent attempt's hash and alive key, a fresh attempt's hash and alive key, then each
#: device's claims, nudge and hold (the leader's first). ARGV: the sent attempt id, the
#: fresh one, ttl ms, precedence, job id, since, group id, leader, devices, nudge ttl ms, '1' if
#: the leader's device runs nothing but this group's job, seq, level. :func:`reserve`'s step (the
#: ``sent`` claim on the leader's device goes either way); returns 1 if it claimed the sent
#: attempt, plus 2 if it started.
_RESERVE = """
local claimed = 0
local run, alive, attempt = KEYS[3], KEYS[4], ARGV[2]
if redis.call('hget', KEYS[1], 'state') == 'sent' and redis.call('exists', KEYS[2]) == 1 then
  claimed, run, alive, attempt = 1, KEYS[1], KEYS[2], ARGV[1]
end
redis.call('hset', run, 'group', ARGV[7], 'job_id', ARGV[5], 'leader', ARGV[8], 'devices', ARGV[9],
           'seq', ARGV[12], 'level', ARGV[13], 'state', 'waiting', 'waiting_for', '{}', 'since', ARGV[6])
redis.call('pexpire', run, ARGV[3])
redis.call('set', alive, 1, 'px', ARGV[3])
redis.call('zrem', KEYS[5], 'sent:' .. ARGV[1])
for i = 5, #KEYS, 3 do
  redis.call('zadd', KEYS[i], ARGV[4], 'group:' .. attempt)
  redis.call('rpush', KEYS[i + 1], 1)
  redis.call('pexpire', KEYS[i + 1], ARGV[10])
end
if ARGV[11] == '1' and redis.call('exists', KEYS[7]) == 0
    and #redis.call('zrangebyscore', KEYS[5], '-inf', '(' .. ARGV[4]) == 0 then
  redis.call('set', KEYS[7], attempt)
end
for i = 7, #KEYS, 3 do
  if redis.call('get', KEYS[i]) ~= attempt then return claimed end
end
redis.call('hset', run, 'state', 'running')
return claimed + 2
"""

#: KEYS: the attempt's hash and alive key, then each device's claims and nudge.
#: ARGV: attempt id, nudge ttl ms. Let an unclaimed attempt go; returns 1 if it was unclaimed.
_RELEASE_UNCLAIMED = """
if redis.call('hget', KEYS[1], 'state') ~= 'sent' then return 0 end
redis.call('del', KEYS[1], KEYS[2])
for i = 3, #KEYS, 2 do
  redis.call('zrem', KEYS[i], 'group:' .. ARGV[1], 'sent:' .. ARGV[1])
  redis.call('rpush', KEYS[i + 1], 1)
  redis.call('pexpire', KEYS[i + 1], ARGV[2])
end
return 1
"""

#: KEYS: the group attempt's hash, then each device's hold. ARGV: attempt id (:func:`start`).
_START = """
for i = 2, #KEYS do
  if redis.call('get', KEYS[i]) ~= ARGV[1] then return 0 end
end
redis.call('hset', KEYS[1], 'state', 'running', 'waiting_for', '{}')
return 1
"""

#: KEYS: the device's hold, the held attempt's hash, its alive key, the wake list of the attempt
#: to hold. ARGV: held attempt id ('' for none), the attempt to hold ('' to let go), the wake
#: list's TTL in ms (:func:`move_hold`; the leader of the attempt now held is woken).
_MOVE_HOLD = """
local held = redis.call('get', KEYS[1]) or ''
if held ~= ARGV[1] then return 0 end
if held ~= '' and redis.call('hget', KEYS[2], 'state') == 'running' and redis.call('exists', KEYS[3]) == 1 then
  return 0
end
if ARGV[2] == '' then
  redis.call('del', KEYS[1])
else
  redis.call('set', KEYS[1], ARGV[2])
  redis.call('rpush', KEYS[4], 1)
  redis.call('pexpire', KEYS[4], ARGV[3])
end
return 1
"""

#: KEYS: each device's hold. ARGV: attempt id. Let go of every hold of this attempt.
_LET_GO = """
for i = 1, #KEYS do
  if redis.call('get', KEYS[i]) == ARGV[1] then redis.call('del', KEYS[i]) end
end
return 1
"""


def _device_keys(devices: Sequence[str]) -> list[str]:
    return [key for device in devices for key in (keys.device_claims(device), keys.group_nudge(device))]


def _eval(pipe: Any, script: str, keys_: list[str], args: list[Any]) -> None:
    """Queue ``script`` on ``pipe`` as an EVAL: a pipeline with registered scripts asks Redis
    whether they are loaded first, one round trip more each time (these scripts are short)."""
    pipe.eval(script, len(keys_), *keys_, *args)


def move_hold(pipe: Any, device: str, held: str, to: str) -> None:
    """Queue on ``pipe`` the move of ``device``'s hold from attempt ``held`` to ``to`` (``''``:
    none), unless the hold changed meanwhile or ``held`` runs; its reply is 1 if it moved."""
    _eval(pipe, _MOVE_HOLD, [keys.group_hold(device), keys.group_run(held or "-"), keys.group_alive(held or "-"),
                             keys.group_wake(to or "-")], [held, to, GROUP_NUDGE_TTL_MS])


def start(pipe: Any, attempt: str, devices: Sequence[str]) -> None:
    """Queue on ``pipe`` the start of ``attempt`` if every one of ``devices`` holds it (it is
    then ``running``, and no keeper moves a hold off it); its reply is 1 if it started."""
    _eval(pipe, _START, [keys.group_run(attempt), *(keys.group_hold(d) for d in devices)], [attempt])


def release(pipe: Any, attempt: str, devices: Sequence[str]) -> None:
    """Queue on ``pipe`` the end of ``attempt``: its claims, keys and holds go, and its devices'
    keepers are nudged (their gates open)."""
    for device in devices:
        pipe.zrem(keys.device_claims(device), claims.member(claims.GROUP, attempt))
    pipe.delete(keys.group_alive(attempt), keys.group_run(attempt), keys.group_wake(attempt))
    _eval(pipe, _LET_GO, [keys.group_hold(d) for d in devices], [attempt])
    claims.nudge(pipe, *devices)


def reserve_at_send(pipe: redis.client.Pipeline, group_id: str, devices: Sequence[str], attempt: str,
                    ttl_s: float, level: Level = DEFAULT_LEVEL) -> None:
    """Queue on ``pipe`` the producer's step: number the group (``keys.CLAIM_SEQ``) and reserve
    its devices (the leader, ``devices[0]``, with a ``sent`` claim) under ``attempt``, unclaimed, for ``ttl_s``, at
    the group's precedence (``level``, its job's, then that seq). Its reply in
    ``pipe.execute()`` is the group's seq."""
    leader = devices[0]
    waiting = json.dumps({leader: "its leader to take the group's message"})
    pipe.eval(_SEND, 3 + 2 * len(devices), keys.CLAIM_SEQ, keys.group_run(attempt), keys.group_alive(attempt),
              *_device_keys(devices), attempt, int(ttl_s * 1000), group_id, leader, ",".join(devices), time.time(),
              waiting, GROUP_NUDGE_TTL_MS, level.value, level_offset(level))


def reserve(client: redis.Redis, *, group_id: str, devices: Sequence[str], seq: int, sent: str | None,
            fresh: str, job_id: str, ttl_ms: int, leader_idle: bool, level: Level = DEFAULT_LEVEL) -> tuple[bool, bool]:
    """The leader's step: claim the attempt ``sent`` reserved at send time if it is unclaimed and
    alive, else reserve every device under ``fresh`` at the group's precedence (``level``, then
    ``seq``); either way for ``ttl_ms``, in state ``waiting``. Where ``leader_idle`` (its worker
    runs nothing but this group's job, and its gate is closed) and no group of higher precedence
    reserved it, the leader's device is held for the attempt; and
    if every device holds it, it starts. Returns (claimed ``sent``, started): the attempt is
    ``sent`` if claimed, else ``fresh``."""
    sent = sent or fresh
    device_keys = [key for device in devices for key in (keys.device_claims(device), keys.group_nudge(device),
                                                         keys.group_hold(device))]
    done = int(client.eval(_RESERVE, 4 + len(device_keys), keys.group_run(sent), keys.group_alive(sent),
                           keys.group_run(fresh), keys.group_alive(fresh), *device_keys,
                           sent, fresh, ttl_ms, precedence(level, seq), job_id, time.time(), group_id,
                           devices[0], ",".join(devices), GROUP_NUDGE_TTL_MS, "1" if leader_idle else "0",
                           seq, level.value))
    return bool(done & 1), bool(done & 2)


def release_unclaimed(client: redis.Redis, devices: Sequence[str], attempt: str) -> bool:
    """Let the devices reserved at send time under ``attempt`` go, if its leader has not claimed
    it (a group cancelled before it started, or never sent). True if it was unclaimed."""
    return bool(client.eval(_RELEASE_UNCLAIMED, 2 + 2 * len(devices), keys.group_run(attempt),
                            keys.group_alive(attempt), *_device_keys(devices), attempt, GROUP_NUDGE_TTL_MS))
