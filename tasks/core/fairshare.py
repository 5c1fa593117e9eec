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
also registers the user in ``keys.USERS`` and adds her to the level list's waiting users,
``keys.waiting_users``, in the same round trip). A worker's blocking read (one ``BRPOP`` over
all its lists, which pops from the first non-empty key in the order given) names, for each
level highest first, the level's shared lists (bookkeeping such as a fan-out's collect step,
which names no user), then the lists of the users waiting beside them, users by usage, least
first (:func:`tasks.core.queue_lists.brpop_keys`), then its queues' wake lists. A user with
nothing waiting costs a worker nothing per poll: her lists are named by no worker, however many
users the fleet has seen (what stays of her is her usage history).

The worker reads the waiting users and their usage again at most every
:data:`~tasks.core.defaults.FAIRSHARE_REFRESH_S` (:class:`UserOrder`: one script call,
:data:`WAITING_READ`), at the start of a read. That read also takes a user out of a list's waiting
users once her list there is empty, in the same script: a publish runs either wholly before
(the list is not empty: she stays) or wholly after (it adds her again), so no message is left in
a list no worker names. A sweep's own queue belongs to one user: its lists are ordered by its
user's usage like any other. Levels still come strictly first: a user's ``batch`` work never
goes before anyone's ``normal`` work.

A user new to a list's waiting users: a worker's read names only the users it found at its last
read, so each of her messages there in her first :data:`~tasks.core.defaults.WAKE_WINDOW_S` also
pushes the list's name to the queue's wake list (``keys.wake``), which every worker of the queue
names last. A worker that pops a mark for a list its read did not name reads the users at once
and polls again: her first job is taken within a few round trips, not at the next refresh.
Marks are kept at most :data:`~tasks.core.defaults.WAKE_KEEP` per queue; one for a list the
worker named already is dropped for one poll. Preemption (:mod:`tasks.worker.preemption`), the
waiting view and the exporter read the waiting users too
(:func:`tasks.core.queue_lists.waiting_users`).

Messages given back to a queue (a dead worker's, kombu's restore) go to its shared list: ahead
of the users' lists of their level, as they were taken once already.

Messages in a user's list that no waiting set names (published by a release that kept no waiting
sets, before an upgrade) would be polled by no worker. So the first read of a list by the fleet
adopts them: every user ever seen whose list beside it holds messages is added to its waiting
users (:data:`ADOPT_WAITING`: one script at a worker's first read of its lists, which checks
each user ever seen, about 2 µs each in Redis, only for a list the fleet has never adopted).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from . import keys
from .defaults import FAIRSHARE_HALF_LIFE_S, FAIRSHARE_REFRESH_S, USAGE_KEEP_DAYS, WAIT_BUCKETS_S
from .priority import Level
from .queue_lists import USER_SEPARATOR
from .replies import text

logger = logging.getLogger(__name__)

#: Put a job's message on its user's list beside its queue list, register the user (first seen,
#: by Redis' clock) and add her to the level list's waiting users; while she is new there (added
#: less than ``ARGV[3]`` seconds ago), push the list's name to the queue's wake list, keeping its
#: newest ``ARGV[4]``. KEYS: the user's list (``cpu:batch~alice``), ``keys.USERS``, the level
#: list's ``keys.waiting_users``, the queue's ``keys.wake``; ARGV: the user, the message, the wake
#: window, the wake marks kept. Returns 1 when the user is new to the fleet.
PUBLISH = """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local new = redis.call('hsetnx', KEYS[2], ARGV[1], t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
local since = tonumber(redis.call('zscore', KEYS[3], ARGV[1]))
if not since then
  since = now
  redis.call('zadd', KEYS[3], now, ARGV[1])
end
redis.call('lpush', KEYS[1], ARGV[2])
if now - since < tonumber(ARGV[3]) then
  redis.call('lpush', KEYS[4], KEYS[1])
  redis.call('ltrim', KEYS[4], 0, tonumber(ARGV[4]) - 1)
end
return new
"""

#: A worker's read of the users waiting beside its level lists: each list's waiting users whose
#: list there is not empty (one whose list is empty is taken out, in the same atomic call: see
#: the module's docstring), and the usage of each. KEYS: ``keys.USAGE``, then each level list's
#: ``keys.waiting_users``; ARGV: the user separator, then each level list's name. Returns
#: ``[[users of each list], [every user found, once], [her usage field, or nil]]``.
WAITING_READ = """
local lists, seen, names = {}, {}, {}
for i = 2, #KEYS do
  local base, kept = ARGV[i], {}
  for _, user in ipairs(redis.call('zrange', KEYS[i], 0, -1)) do
    if redis.call('exists', base .. ARGV[1] .. user) == 1 then
      kept[#kept + 1] = user
      if not seen[user] then
        seen[user] = true
        names[#names + 1] = user
      end
    else
      redis.call('zrem', KEYS[i], user)
    end
  end
  lists[#lists + 1] = kept
end
local usage = {}
if #names > 0 then usage = redis.call('hmget', KEYS[1], unpack(names)) end
return {lists, names, usage}
"""

#: Add to each level list's waiting users every user ever seen (``keys.USERS``) whose list beside
#: it holds messages (published with no waiting set to name them: the module's docstring), once
#: a fleet for each list (``keys.WAITING_ADOPTED``). KEYS: ``keys.USERS``,
#: ``keys.WAITING_ADOPTED``, then each level list's ``keys.waiting_users``; ARGV: the user
#: separator, then each level list's name. Returns how many users it added.
ADOPT_WAITING = """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local users, added = nil, 0
for i = 3, #KEYS do
  if redis.call('sadd', KEYS[2], ARGV[i - 1]) == 1 then
    users = users or redis.call('hkeys', KEYS[1])
    for _, user in ipairs(users) do
      if redis.call('exists', ARGV[i - 1] .. ARGV[1] .. user) == 1 then
        added = added + redis.call('zadd', KEYS[i], 'NX', now, user)
      end
    end
  end
end
return added
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



@dataclass(frozen=True)
class Waiting:
    """A worker's read of its users: each level list's waiting users (``beside``), and all of
    them in serving order (``order``, least usage first)."""

    beside: Mapping[str, frozenset[str]]
    order: tuple[str, ...]


class UserOrder:
    """A worker's users waiting beside its level lists, in serving order, read again at most
    every ``refresh_s`` (or at once after :meth:`stale`): one script call (:data:`WAITING_READ`)."""

    def __init__(self, refresh_s: float = FAIRSHARE_REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_s = refresh_s
        self._clock = clock
        self._waiting = Waiting({}, ())
        self._names: frozenset[str] = frozenset()
        self._read_at: float | None = None
        self._script: Any = None
        #: The level lists this process adopted the waiting users of (:data:`ADOPT_WAITING`).
        self._adopted: set[str] = set()

    def stale(self) -> None:
        """Read again at the next :meth:`read` (a wake mark named a list the last read did not)."""
        self._read_at = None

    def users(self, client: redis.Redis, names: Sequence[str] = ()) -> list[str]:
        """The users waiting beside level lists ``names``, least usage first (:meth:`read`)."""
        return list(self.read(client, names).order)

    def read(self, client: redis.Redis, names: Sequence[str]) -> Waiting:
        """The users waiting beside level lists ``names``; the last read if it is younger than
        the refresh period and was of these lists (in any order: kombu's cycle turns them), or if Redis does not answer now (the poll
        that follows says so)."""
        now, names = self._clock(), tuple(names)
        if new := [name for name in names if name not in self._adopted]:
            self._adopt(client, new)
        if self._read_at is not None and now - self._read_at < self.refresh_s and self._names.issuperset(names):
            return self._waiting
        try:
            if self._script is None:
                self._script = client.register_script(WAITING_READ)
            lists, found, usage = self._script(keys=[keys.USAGE, *(keys.waiting_users(name) for name in names)],
                                               args=[USER_SEPARATOR, *names], client=client)
        except redis.RedisError as exc:
            logger.debug("could not read the waiting users: %s", exc)
            return self._waiting
        users = [text(user) for user in found]
        order = order_users(users, parse_usage({u: v for u, v in zip(users, usage, strict=True) if v is not None},
                                               time.time()))
        self._waiting = Waiting({name: frozenset(text(u) for u in listed) for name, listed in zip(names, lists, strict=True)},
                                tuple(order))
        self._names, self._read_at = frozenset(names), now
        return self._waiting

    def _adopt(self, client: redis.Redis, names: Sequence[str]) -> None:
        """Adopt the waiting users of ``names`` (:data:`ADOPT_WAITING`); tried again at the next
        read where Redis did not answer, never where it refused (credentials without the right)."""
        try:
            added = client.eval(ADOPT_WAITING, 2 + len(names), keys.USERS, keys.WAITING_ADOPTED,
                                *(keys.waiting_users(name) for name in names), USER_SEPARATOR, *names)
        except redis.exceptions.NoPermissionError as exc:
            logger.warning("could not look for user lists no worker polls beside %s: %s", ", ".join(names), exc)
        except redis.RedisError as exc:
            logger.debug("could not look for user lists no worker polls yet: %s", exc)
            return
        else:
            if added:
                logger.warning("found %d user list(s) beside %s with messages no worker polled: polled now",
                               added, ", ".join(names))
        self._adopted.update(names)


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
