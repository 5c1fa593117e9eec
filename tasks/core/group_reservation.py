"""A device group's reservation in Redis: the part its producer and its leader share.

The protocol as a whole is in :mod:`tasks.worker.group`; this module holds the steps both sides
take on the same keys, so that each is one script (one round trip, atomic):

- :func:`reserve_at_send`: the **producer**, as it sends a group, gives it its age (``seq``) and
  reserves its devices other than the leader, each reservation scored by the group's precedence
  (:func:`tasks.core.priority.precedence`: its job's level, then its age) (the leader's own queue is first in, first out: what
  was sent to it before the group runs before it, what is sent after waits behind it). The
  reservation's ``alive`` key lives :data:`~tasks.core.defaults.GROUP_CLAIM_TTL_S`: a group whose
  message no leader takes in that time (its producer died before sending it, or the leader's
  queue is long) lets the devices go, and its leader reserves them again when it takes it;
- :func:`reserve`: the **leader**, taking the message, claims that reservation (it renews it to a
  lease's TTL and adds its own device) if it is still unclaimed and alive, else reserves anew
  under a fresh attempt id;
- :func:`release_unclaimed`: a producer cancelling a group its leader has not taken yet lets its
  devices go at once (a claimed group is its leader's to release: it sees the cancel).

Every step that changes a device's reservations **nudges** that device's keeper
(:func:`tasks.core.keys.group_nudge`, a list its keeper waits on with ``BLPOP``), and a keeper
that holds its device for a group **wakes** the group's leader
(:func:`tasks.core.keys.group_wake`): nobody waits out a poll on the way to a start. The polls
stay as the fallback (a lost nudge, a leader whose ``alive`` key expired). A leader waits on its
wake list for :data:`~tasks.core.defaults.GROUP_POLL_S` at most: a fractional ``BLPOP`` timeout,
which Redis takes from 6.0 on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from . import keys
from .defaults import GROUP_NUDGE_TTL_MS
from .priority import DEFAULT_LEVEL, Level, level_offset, precedence

#: KEYS: GROUP_SEQ, the attempt's hash, its alive key, then each other device's reservations and
#: nudge. ARGV: attempt id, ttl ms, group id, leader, devices (comma list), since, waiting_for,
#: nudge ttl ms, level, the level's offset (:func:`tasks.core.priority.level_offset`). Scores
#: each reservation with the group's precedence (its seq plus the offset). Returns the group's seq.
_SEND = """
local seq = redis.call('incr', KEYS[1])
local score = string.format('%.0f', seq + tonumber(ARGV[10]))
redis.call('hset', KEYS[2], 'group', ARGV[3], 'leader', ARGV[4], 'devices', ARGV[5], 'seq', seq,
           'level', ARGV[9], 'state', 'sent', 'waiting_for', ARGV[7], 'since', ARGV[6])
redis.call('pexpire', KEYS[2], ARGV[2])
redis.call('set', KEYS[3], 1, 'px', ARGV[2])
for i = 4, #KEYS, 2 do
  redis.call('zadd', KEYS[i], score, ARGV[1])
  redis.call('rpush', KEYS[i + 1], 1)
  redis.call('pexpire', KEYS[i + 1], ARGV[8])
end
return seq
"""

#: KEYS: the sent attempt's hash and alive key, a fresh attempt's hash and alive key, then each
#: device's reservations, nudge and hold (the leader's first). ARGV: the sent attempt id, the
#: fresh one, ttl ms, precedence, job id, since, group id, leader, devices, nudge ttl ms, '1' if
#: the leader's device runs nothing but this group's job, seq, level.
#: Claim the sent attempt if it is unclaimed and alive, else reserve under the fresh one (its
#: hash says ``waiting``); hold the leader's device if it runs nothing else, no group of higher
#: precedence reserved it and no group holds it; start (``running``) if every device holds the attempt.
#: Returns 1 if it claimed the sent attempt, plus 2 if it started.
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
for i = 5, #KEYS, 3 do
  redis.call('zadd', KEYS[i], ARGV[4], attempt)
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

#: KEYS: the attempt's hash and alive key, then each reserved device's reservations and nudge.
#: ARGV: attempt id, nudge ttl ms. Let an unclaimed attempt go; returns 1 if it was unclaimed.
_RELEASE_UNCLAIMED = """
if redis.call('hget', KEYS[1], 'state') ~= 'sent' then return 0 end
redis.call('del', KEYS[1], KEYS[2])
for i = 3, #KEYS, 2 do
  redis.call('zrem', KEYS[i], ARGV[1])
  redis.call('rpush', KEYS[i + 1], 1)
  redis.call('pexpire', KEYS[i + 1], ARGV[2])
end
return 1
"""


def _device_keys(devices: Sequence[str]) -> list[str]:
    return [key for device in devices for key in (keys.group_reservations(device), keys.group_nudge(device))]


def nudge(pipe: Any, device: str) -> None:
    """Queue on ``pipe`` (a pipeline or a client) the nudge that wakes ``device``'s keeper."""
    pipe.rpush(keys.group_nudge(device), 1)
    pipe.pexpire(keys.group_nudge(device), GROUP_NUDGE_TTL_MS)


def reserve_at_send(pipe: redis.client.Pipeline, group_id: str, devices: Sequence[str], attempt: str,
                    ttl_s: float, level: Level = DEFAULT_LEVEL) -> None:
    """Queue on ``pipe`` the producer's step: number the group (``keys.GROUP_SEQ``) and reserve
    its devices but the leader (``devices[0]``) under ``attempt``, unclaimed, for ``ttl_s``, at
    the group's precedence (``level``, its job's, then that seq). Its reply in
    ``pipe.execute()`` is the group's seq."""
    leader = devices[0]
    waiting = json.dumps({leader: "its leader to take the group's message"})
    pipe.eval(_SEND, 3 + 2 * (len(devices) - 1), keys.GROUP_SEQ, keys.group_run(attempt), keys.group_alive(attempt),
              *_device_keys(devices[1:]), attempt, int(ttl_s * 1000), group_id, leader, ",".join(devices), time.time(),
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
    device_keys = [key for device in devices for key in (keys.group_reservations(device), keys.group_nudge(device),
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
    return bool(client.eval(_RELEASE_UNCLAIMED, 2 + 2 * (len(devices) - 1), keys.group_run(attempt),
                            keys.group_alive(attempt), *_device_keys(devices[1:]), attempt, GROUP_NUDGE_TTL_MS))
