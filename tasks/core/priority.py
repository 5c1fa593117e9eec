"""Priorities: the level a job runs at, the user who sent it, and how a worker keeps the order.

A job carries a :class:`Level` (``urgent``, ``normal``, the default, or ``batch``) and the user who
sent it, in its :class:`~tasks.core.records.JobOptions`. The level picks the queue: every queue
of the fleet (a device's, a kind's, ``fleet``, a sweep's) has one list per level, the level after
:data:`~tasks.core.queue_lists.LEVEL_SEPARATOR` (``device.cpu0:urgent``, ``cpu:batch``,
``sweep.s1:urgent``); a ``normal`` job goes to the bare name, the queue it went to before levels
existed. :mod:`tasks.core.queue_lists` names every list of a queue.

How the order is kept: a worker waits for its next job with one Redis ``BRPOP`` over all the
lists it consumes, and ``BRPOP`` pops from the first non-empty list in the order the keys are
given. kombu's Redis channel builds that order from its queue cycle, which
:class:`tasks.core.transport.LevelCycle` keeps sorted by level: every ``urgent`` list first,
then the ``normal`` ones, then ``batch``. Within a level the queues take turns as they always
did (the list a message just came from goes to the end of its level's lists, as kombu's default
``round_robin`` moves it to the end of all of them), so a fleet-wide sweep does not starve a
fan-out's collect step of the same level. So a free device takes a message of the highest level
waiting in any queue it consumes, first come first served within each list. Nothing else is
stored and no message is read twice: the cost per job is nil in round trips, and more keys in
each ``BRPOP`` (three lists per queue).

Prefetch cannot let a lower job jump a higher one: a worker holds one unacknowledged message per
slot (``worker_prefetch_multiplier = 1`` with ``task_acks_late``, :mod:`tasks.core.app`), and
kombu starts the next ``BRPOP`` only while it holds fewer than that (its QoS's
``can_consume``). A busy device has no message in hand; the one it takes when a slot frees is
chosen at that moment, among everything then queued.

Within a level, users share fairly (:mod:`tasks.core.fairshare`): each list of a level has one
list per user beside it, :data:`~tasks.core.queue_lists.USER_SEPARATOR` and the user after its
name (``cpu:batch~alice``), and a worker names the users' lists in the order of their usage, least first.

Work that needs several devices at once (a distributed job's gang, a device group) waits for its
devices by *wait-die* over one :func:`precedence`: its level first (a higher level wins, whatever
the ages), then its age (older wins). :mod:`tasks.worker.gang` and :mod:`tasks.worker.group` both
rank by it; a single job of a higher level than every group that reserved its device does not
wait for them (:class:`tasks.worker.group.GroupGate`).
"""

from __future__ import annotations

import functools
import getpass
import re
from enum import Enum
from typing import Any

from .errors import ConfigError

#: What a user name may be: what ``devicefleet status`` shows and Prometheus labels carry.
USER_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.@\-]{0,63}$"
#: The user of a job sent by a process whose OS user cannot be read (no passwd entry in a
#: container) and that named none.
UNKNOWN_USER = "unknown"


class Level(str, Enum):
    """How urgent a job is; a free device takes the highest level first. In order, highest first."""

    URGENT = "urgent"
    NORMAL = "normal"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 for the highest level: the order a worker takes its queues in."""
        return _RANKS[self]


_RANKS = {level: rank for rank, level in enumerate(Level)}
#: The level of a job that names none.
DEFAULT_LEVEL = Level.NORMAL

#: How far one level moves a precedence: more than any age (a fleet-wide counter) reaches, and
#: exact in a Redis sorted set's score (a double: integers to 2**53).
LEVEL_PRECEDENCE = 2**40


def precedence(level: Level, age: int) -> int:
    """The place in wait-die of work of ``level`` numbered ``age`` (a fleet-wide counter at send
    time, ``0 <= age < LEVEL_PRECEDENCE``): lower goes first. Level first, then age, so an
    ``urgent`` gang or group sent last goes before a ``batch`` one sent long before. A ``normal``
    one's is its age (what it was before levels counted). A sorted set's score as is.

    Raises:
        ValueError: ``age`` is out of range.
    """
    if not 0 <= age < LEVEL_PRECEDENCE:
        raise ValueError(f"age {age} is out of range: 0 <= age < {LEVEL_PRECEDENCE}")
    return age + level_offset(level)


def level_offset(level: Level) -> int:
    """What ``level`` adds to an age in its :func:`precedence` (for a script that numbers the
    work itself, as a group's reservation at send time does)."""
    return (level.rank - DEFAULT_LEVEL.rank) * LEVEL_PRECEDENCE


def level_of(value: float) -> Level:
    """The level of the :func:`precedence` ``value`` (a sorted set's score, a float, is taken)."""
    return list(Level)[int(value) // LEVEL_PRECEDENCE + DEFAULT_LEVEL.rank]


def parse_level(value: Any) -> Level:
    """``value`` (a :class:`Level` or its name, any case) as a :class:`Level`.

    Raises:
        ConfigError: not a level; the message names the value and the levels.
    """
    if isinstance(value, Level):
        return value
    if isinstance(value, str):
        try:
            return Level(value.strip().lower())
        except ValueError:
            pass
    raise ConfigError(f"priority {value!r} is not a level: use one of "
                      f"{', '.join(level.value for level in Level)} (highest first; default {DEFAULT_LEVEL.value})")


def check_user(value: str) -> str:
    """``value`` if it is a valid user name.

    Raises:
        ConfigError: it is not; the message names it.
    """
    if not isinstance(value, str) or not re.fullmatch(USER_PATTERN, value):
        raise ConfigError(f"user {value!r} is not a user name: letters, digits and _.@- "
                          "(at most 64, not starting with . @ or -)")
    return value


@functools.lru_cache(maxsize=1)
def os_user() -> str:
    """The OS user of this process (the default user of the jobs it sends), read once."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (a bare container)
        return UNKNOWN_USER
    return name if re.fullmatch(USER_PATTERN, name) else UNKNOWN_USER
