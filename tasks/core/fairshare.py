"""Fair share between users within a level: a free device takes the work of the user who has
used the fleet least.

Usage is device-seconds, decayed over a half-life (:data:`~tasks.core.defaults.FAIRSHARE_HALF_LIFE_S`,
an hour): a job's seconds count fully when it ends, half as much a half-life later. It is kept in Redis as ``(value, stamp)`` per user (``keys.USAGE``): the script
that stores a job's result (:data:`tasks.core.jobscripts.STORE`) decays the user's value to the
job's end and adds the job's seconds (:data:`USAGE_LUA`), in the call it makes anyway; a reader
decays it to now (:func:`decayed`). So nothing is written per job that was not written already,
and the order costs no round trip per job.

How a device picks a user: every list of a level (``cpu:batch``) has one list per user beside
it (``cpu:batch~alice``, :func:`tasks.core.queue_lists.user_list`). The fleet's transport publishes
a job to its user's list (:data:`PUBLISH`: one script call instead of kombu's ``LPUSH``, which
also registers the user in ``keys.USERS``, the same round trip). A worker's blocking read (one ``BRPOP`` over all its
lists, which pops from the first non-empty key in the order given) names, for each level
highest first, the level's shared lists (bookkeeping such as a fan-out's collect step, which
names no user), then every user's lists, users by usage, least first
(:func:`tasks.core.queue_lists.brpop_keys`). The
worker reads the users and their usage again at most every
:data:`~tasks.core.defaults.FAIRSHARE_REFRESH_S` (:class:`UserOrder`: one pipelined round trip),
at the start of a read. A sweep's own queue belongs to one user: its lists are ordered by its
user's usage like any other. Levels still come strictly first: a user's ``batch`` work never
goes before anyone's ``normal`` work.

A user's very first jobs: a worker's read names only the users it knew when it began, so a new
user's first jobs wait until each worker's next read that comes after a refresh: at most kombu's
``brpop_timeout`` (1 s) plus :data:`~tasks.core.defaults.FAIRSHARE_REFRESH_S` for an idle worker,
once per user in the fleet's life. A busy worker refreshes at the start of its next read (its
order is older than the refresh period by then, unless it took a job in the last half second);
preemption (:mod:`tasks.worker.preemption`) reads the users afresh at each look.

Messages given back to a queue (a dead worker's, kombu's restore) go to its shared list: ahead
of the users' lists of their level, as they were taken once already.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from . import keys
from .defaults import FAIRSHARE_HALF_LIFE_S, FAIRSHARE_REFRESH_S, USAGE_KEEP_DAYS, WAIT_BUCKETS_S
from .priority import Level

logger = logging.getLogger(__name__)

#: Put a job's message on its user's list beside its queue list, and register the user (first
#: seen, by Redis' clock). KEYS: the user's list (``cpu:batch~alice``), ``keys.USERS``; ARGV: the
#: user, the message. Returns 1 when the user is new.
PUBLISH = """
local t = redis.call('time')
local new = redis.call('hsetnx', KEYS[2], ARGV[1], t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
redis.call('lpush', KEYS[1], ARGV[2])
return new
"""

#: A Lua function of the store script (:data:`tasks.core.jobscripts.STORE`): add a job's
#: device-seconds to its user's usage (``keys.USAGE``, decayed to the job's end first) and to the
#: level's and user's counter (``keys.USER_SECONDS``), and its wait to its level's histogram.
#: ``share``: ``{user, level, seconds, at, half_life}`` or empty; ``wait``: ``{key, bucket,
#: seconds}`` or empty (:func:`share_arg`, :func:`wait_arg`).
USAGE_LUA = """
local add_usage = function(usage_key, seconds_key, share, wait)
  if share.user then
    local value, stamp = 0, tonumber(share.at)
    local raw = redis.call('hget', usage_key, share.user)
    if raw then
      local v, s = string.match(raw, '^(%S+) (%S+)$')
      value, stamp = tonumber(v) or 0, tonumber(s) or stamp
    end
    local at, add = tonumber(share.at), tonumber(share.seconds)
    local half = tonumber(share.half_life)
    if at >= stamp then
      value = value * math.pow(0.5, (at - stamp) / half) + add
      stamp = at
    else
      value = value + add * math.pow(0.5, (stamp - at) / half)
    end
    redis.call('hset', usage_key, share.user, string.format('%.17g %.6f', value, stamp))
    redis.call('hincrbyfloat', seconds_key, share.level .. ':' .. share.user, share.seconds)
    if share.totals then
      local at = tonumber(share.at)
      local day = share.days .. string.format('%d', math.floor(at / 86400))
      local who = share.user .. ' ' .. share.kind
      local hour = string.format('%d', math.floor(at / 3600) * 3600) .. ' ' .. who
      redis.call('hincrbyfloat', share.totals, who .. ' held', share.seconds)
      redis.call('hincrbyfloat', day, hour .. ' held', share.seconds)
      if share.busy then
        redis.call('hincrbyfloat', share.totals, who .. ' busy', share.busy)
        redis.call('hincrbyfloat', day, hour .. ' busy', share.busy)
      end
      redis.call('expire', day, share.keep)
    end
  end
  if wait.key then
    redis.call('hincrby', wait.key, wait.bucket, 1)
    redis.call('hincrby', wait.key, 'count', 1)
    redis.call('hincrbyfloat', wait.key, 'sum', wait.seconds)
  end
end
"""


def decayed(value: float, stamp: float, now: float, half_life_s: float = FAIRSHARE_HALF_LIFE_S) -> float:
    """``value`` (device-seconds as of ``stamp``) decayed to ``now``: halved every ``half_life_s``.
    A stamp in the future (another host's clock) is taken as now."""
    return value * math.pow(0.5, max(0.0, now - stamp) / half_life_s)


def parse_usage(raw: Mapping[Any, Any], now: float, half_life_s: float = FAIRSHARE_HALF_LIFE_S) -> dict[str, float]:
    """``{user: usage decayed to now}`` from ``keys.USAGE``'s fields (bytes or str); a field that
    does not parse is left out."""
    out: dict[str, float] = {}
    for user, value in raw.items():
        try:
            text = value.decode() if isinstance(value, bytes) else str(value)
            amount, stamp = (float(part) for part in text.split())
        except ValueError:
            continue
        out[user.decode() if isinstance(user, bytes) else str(user)] = decayed(amount, stamp, now, half_life_s)
    return out


def order_users(users: Iterable[str], usage: Mapping[str, float]) -> list[str]:
    """``users`` in the order a free device serves them: least usage first (none: 0), then by
    name, so every worker orders them alike."""
    return sorted(set(users), key=lambda user: (usage.get(user, 0.0), user))


def read_usage(client: redis.Redis, now: float | None = None) -> dict[str, float]:
    """Every user's usage now (device-seconds, decayed), one ``HGETALL``."""
    return parse_usage(client.hgetall(keys.USAGE), time.time() if now is None else now)


def known_users(client: redis.Redis) -> list[str]:
    """Every user who has sent a job (``keys.USERS``), by name, one ``HKEYS``."""
    return sorted(u.decode() if isinstance(u, bytes) else str(u) for u in client.hkeys(keys.USERS))


class UserOrder:
    """A worker's users in serving order, read again at most every ``refresh_s``: one pipelined
    round trip (``HKEYS`` of the users, ``HGETALL`` of their usage)."""

    def __init__(self, refresh_s: float = FAIRSHARE_REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_s = refresh_s
        self._clock = clock
        self._users: list[str] = []
        self._read_at: float | None = None

    def users(self, client: redis.Redis) -> list[str]:
        """The users, least usage first; the last order read if Redis does not answer now (the
        read that follows says so)."""
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self.refresh_s:
            return self._users
        try:
            with client.pipeline(transaction=False) as pipe:
                pipe.hkeys(keys.USERS)
                pipe.hgetall(keys.USAGE)
                names, usage = pipe.execute()
        except redis.RedisError as exc:
            logger.debug("could not read the users' usage: %s", exc)
            return self._users
        users = [u.decode() if isinstance(u, bytes) else str(u) for u in names]
        self._users = order_users(users, parse_usage(usage, time.time()))
        self._read_at = now
        return self._users


def share_arg(user: str | None, level: Level, seconds: float, at: float, *, kind: str | None = None,
              busy_s: float | None = None) -> dict[str, str]:
    """What :data:`USAGE_LUA` adds for a job of ``user`` at ``level`` that ran ``seconds`` and
    ended at ``at`` (epoch seconds); empty when the job names no user. With the device's
    ``kind``, its held seconds by kind too, ever (``keys.USAGE_TOTALS``) and in its hour
    (``keys.usage_day``), and ``busy_s`` (the seconds its process kept the device busy, where
    measured: at most ``seconds``) its busy seconds."""
    if not user:
        return {}
    share = {"user": user, "level": level.value, "seconds": repr(float(seconds)), "at": repr(float(at)),
             "half_life": repr(float(FAIRSHARE_HALF_LIFE_S))}
    if kind:
        share.update(totals=keys.USAGE_TOTALS, days=keys.usage_day(""), kind=kind,
                     keep=str(USAGE_KEEP_DAYS * 86400))
        if busy_s is not None:
            share["busy"] = repr(min(float(seconds), max(0.0, float(busy_s))))
    return share


def wait_bucket(seconds: float) -> str:
    """The histogram field a wait of ``seconds`` falls in: ``le:<bound>``, ``le:+Inf`` past the last."""
    for bound in WAIT_BUCKETS_S:
        if seconds <= bound:
            return f"le:{bound:g}"
    return "le:+Inf"


def wait_arg(level: Level, seconds: float | None) -> dict[str, str]:
    """What :data:`USAGE_LUA` adds to ``level``'s wait histogram for a wait of ``seconds``; empty
    when the send time is not known."""
    if seconds is None:
        return {}
    seconds = max(0.0, float(seconds))
    return {"key": keys.wait_times(level.value), "bucket": wait_bucket(seconds), "seconds": repr(seconds)}


def read_wait_times(client: redis.Redis) -> dict[Level, dict[str, float]]:
    """``{level: {field: value}}`` of each level's wait histogram (``le:<bound>``, ``count``, ``sum``)."""
    with client.pipeline(transaction=False) as pipe:
        for level in Level:
            pipe.hgetall(keys.wait_times(level.value))
        raw = pipe.execute()
    return {level: {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in fields.items()}
            for level, fields in zip(Level, raw, strict=True)}


def read_user_seconds(client: redis.Redis) -> dict[tuple[str, str], float]:
    """``{(user, level): device-seconds}`` of every job ever ended (``keys.USER_SECONDS``)."""
    out: dict[tuple[str, str], float] = {}
    for field, value in client.hgetall(keys.USER_SECONDS).items():
        text = field.decode() if isinstance(field, bytes) else str(field)
        level, _, user = text.partition(":")
        out[(user, level)] = float(value)
    return out
