"""A queue's Redis lists: their names, the order a worker reads them in, and how many messages
wait in them. The one module that builds or parses a list's name; the transport, preemption, the
waiting view, the exporter and the tests ask it.

One queue (``cpu``, ``device.cpu0``, ``fleet``, ``sweep.s1``: :mod:`tasks.core.queues`) is:

- one list per level (:class:`~tasks.core.priority.Level`), the level after
  :data:`LEVEL_SEPARATOR`: ``cpu:urgent``, ``cpu`` (``normal``: the bare name, the queue it was
  before levels existed), ``cpu:batch``. These are the queues kombu knows (a worker consumes
  each; :func:`leveled`);
- beside each level's list, one list per user (fair share, :mod:`tasks.core.fairshare`), the user
  after :data:`USER_SEPARATOR`: ``cpu:batch~alice``. A job that names its user is published there;
  the level's own list holds the jobs that name none (a fan-out's collect step) and messages given
  back to the queue;
- beside each level's list, kombu's lists of its priority steps (a message sent with a Celery
  ``priority``, which devicefleet itself never sets): ``cpu:batch\\x06\\x163``
  (:data:`KOMBU_STEP_SEPARATOR`, :data:`KOMBU_PRIORITY_STEPS`, as kombu's ``Channel._q_for_pri``
  names them; ``tests/test_kombu_guard.py`` holds the two alike).

A worker reads them with one ``BRPOP`` (:func:`brpop_keys`): for each level, highest first, the
level's lists of its queues, then each user's list beside each of them, users by usage; kombu's
step lists last. :class:`QueueLists` is one queue's lists as a record.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import keys
from .priority import DEFAULT_LEVEL, USER_PATTERN, Level

#: Between a queue's name and its level: ``device.cpu0:urgent``. Not a character of a device,
#: kind, sweep or host name (``cpu0@host`` is a device under host naming), so a name never reads
#: as a level.
LEVEL_SEPARATOR = ":"
#: Between a level list's name and the user whose jobs it holds: ``cpu:batch~alice``
#: (:mod:`tasks.core.fairshare`). Not a character of a user name, nor of a queue's.
USER_SEPARATOR = "~"
#: kombu's Redis channel: between a list's name and its priority step (``Channel.sep``).
KOMBU_STEP_SEPARATOR = "\x06\x16"
#: kombu's Redis channel: its priority steps (``Channel.priority_steps``); step 0 is the list itself.
KOMBU_PRIORITY_STEPS: tuple[int, ...] = (0, 3, 6, 9)

_LEVEL_OF_SUFFIX = {level.value: level for level in Level if level is not DEFAULT_LEVEL}


def level_queue(queue: str, level: Level) -> str:
    """The list of ``queue`` that holds ``level``'s jobs: the bare name for ``normal``."""
    if level is DEFAULT_LEVEL:
        return queue
    return f"{queue}{LEVEL_SEPARATOR}{level.value}"


def leveled(queues: Iterable[str]) -> list[str]:
    """Each of ``queues`` at every level, in the order a worker takes them: every level's lists,
    highest level first, each level in the order of ``queues``."""
    queues = list(queues)
    return [level_queue(queue, level) for level in Level for queue in queues]


def user_list(name: str, user: str) -> str:
    """The list beside level list ``name`` that holds ``user``'s jobs: ``cpu:batch~alice``."""
    return f"{name}{USER_SEPARATOR}{user}"


def user_lists(name: str, users: Iterable[str]) -> list[str]:
    """The lists of each of ``users`` beside level list ``name``, in the order of ``users``."""
    return [user_list(name, user) for user in users]


def lists_beside(name: str, users: Iterable[str]) -> list[str]:
    """Level list ``name`` and each of ``users``'s list beside it: every list fair share puts
    ``name``'s jobs in, in the order a worker reads them (kombu's step lists apart)."""
    return [name, *user_lists(name, users)]


def step_list(name: str, step: int, sep: str = KOMBU_STEP_SEPARATOR) -> str:
    """kombu's list of priority ``step`` beside list ``name`` (step 0: ``name`` itself), as
    kombu's ``Channel._q_for_pri`` names it for a step of its ``priority_steps`` (``sep``: the
    channel's ``sep``, a transport option)."""
    return f"{name}{sep}{step}" if step else name


def step_lists(name: str, steps: Iterable[int] = KOMBU_PRIORITY_STEPS, sep: str = KOMBU_STEP_SEPARATOR) -> list[str]:
    """kombu's lists of the non-zero priority ``steps`` beside list ``name``."""
    return [step_list(name, step, sep) for step in steps if step]


def split_user(name: str) -> tuple[str, str | None]:
    """``(level list, user)`` of a list's name: ``cpu:batch~alice`` -> ``("cpu:batch", "alice")``;
    a list that is no user's -> ``(name, None)``."""
    base, sep, user = name.rpartition(USER_SEPARATOR)
    if sep and re.fullmatch(USER_PATTERN, user):
        return base, user
    return name, None


def split_level(name: str) -> tuple[str, Level]:
    """``(queue, level)`` of a list's name (a user's too): ``cpu:urgent`` -> ``("cpu", URGENT)``,
    ``cpu:batch~alice`` -> ``("cpu", BATCH)``."""
    name = split_user(name)[0]
    base, sep, suffix = name.rpartition(LEVEL_SEPARATOR)
    if sep and suffix in _LEVEL_OF_SUFFIX:
        return base, _LEVEL_OF_SUFFIX[suffix]
    return name, DEFAULT_LEVEL


def queue_rank(name: str) -> int:
    """The rank of a list's level (0: consumed first)."""
    return split_level(name)[1].rank


def insert_in_level(order: list[str], name: str) -> None:
    """Put level list ``name`` last among the lists of its level in ``order`` (sorted by level),
    before any lower level's: where kombu's queue cycle puts a queue added or just used
    (:class:`tasks.core.transport.LevelCycle`)."""
    rank = queue_rank(name)
    at = next((i for i, listed in enumerate(order) if queue_rank(listed) > rank), len(order))
    order.insert(at, name)


def known_users(client: Any) -> list[str]:
    """Every user who has ever sent a job (``keys.USERS``), by name, one ``HKEYS``: never on a
    hot path (a worker reads the users waiting, :func:`waiting_users`)."""
    return sorted(u.decode() if isinstance(u, bytes) else str(u) for u in client.hkeys(keys.USERS))


def waiting_users(client: Any, names: Sequence[str]) -> dict[str, list[str]]:
    """``{level list: its waiting users}`` (``keys.waiting_users``, by name) of each of level
    lists ``names``: one pipelined ``ZRANGE`` each, read only. A user may be listed whose list
    is empty by now (a worker's read takes her out, :data:`tasks.core.fairshare.WAITING_READ`):
    her list counts nothing."""
    if not names:
        return {}
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zrange(keys.waiting_users(name), 0, -1)
        found = pipe.execute()
    return {name: sorted(u.decode() if isinstance(u, bytes) else str(u) for u in users)
            for name, users in zip(names, found, strict=True)}


def wake_list(name: str) -> str:
    """The wake list (``keys.wake``) of the queue of list ``name`` (``cpu:batch~alice`` -> ``cpu``'s)."""
    return keys.wake(split_level(name)[0])


def brpop_keys(names: Sequence[str], users: Sequence[str], steps: Iterable[int] = (),
               sep: str = KOMBU_STEP_SEPARATOR, beside: Mapping[str, Collection[str]] | None = None,
               ) -> list[tuple[str, str]]:
    """``(list, level list)`` for a worker's blocking read over level lists ``names`` (sorted by
    level, as :class:`tasks.core.transport.LevelCycle` keeps them), in the order it names them:
    for each level, its level lists, then each user's (``users`` in serving order) beside each of
    them (with ``beside``, only where the user waits beside it: ``beside[name]``); then kombu's
    lists of each non-zero priority step of ``steps``, beside each level list.
    The level list is the queue a message popped from the list is delivered as."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(names):
        rank = queue_rank(names[i])
        group = []
        while i < len(names) and queue_rank(names[i]) == rank:
            group.append(names[i])
            i += 1
        out.extend((name, name) for name in group)
        out.extend((user_list(name, user), name) for user in users for name in group
                   if beside is None or user in beside.get(name, ()))
    out.extend((step_list(name, step, sep), name) for step in steps if step for name in names)
    return out


def count_waiting(client: Any, names: Sequence[str]) -> list[int]:
    """How many messages wait in each of lists ``names``: one pipelined round trip of ``LLEN``."""
    if not names:
        return []
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(name)
        return [int(n) for n in pipe.execute()]


@dataclass(frozen=True)
class QueueLists:
    """The Redis lists of one queue (``cpu``, ``sweep.s1``), for ``users`` (the users who have
    sent a job, ``keys.USERS``; in serving order where the order matters) and kombu's priority
    ``steps``."""

    queue: str
    users: tuple[str, ...] = ()
    steps: tuple[int, ...] = KOMBU_PRIORITY_STEPS

    @classmethod
    def read(cls, client: Any, queue: str) -> QueueLists:
        """``queue``'s lists for every user who has sent a job (by name), one ``HKEYS``."""
        return cls(queue, tuple(known_users(client)))

    @classmethod
    def waiting(cls, client: Any, queue: str) -> QueueLists:
        """``queue``'s lists for the users waiting beside any of its level lists (by name), one
        pipelined round trip: what a hot path reads instead of every user ever seen."""
        found = waiting_users(client, [level_queue(queue, level) for level in Level])
        return cls(queue, tuple(sorted({user for users in found.values() for user in users})))

    def level(self, level: Level) -> str:
        """The queue's own list of ``level`` (jobs that name no user, messages given back)."""
        return level_queue(self.queue, level)

    def of_level(self, level: Level, *, steps: bool = False) -> list[str]:
        """The lists of ``level``: its own, then each user's beside it in the order of
        :attr:`users`; with ``steps``, kombu's step lists beside it too."""
        name = self.level(level)
        return [*lists_beside(name, self.users), *(step_lists(name, self.steps) if steps else ())]

    def push_list(self, level: Level, user: str | None) -> str:
        """The list a job of ``level`` published by ``user`` goes to (its own list: ``None``)."""
        name = self.level(level)
        return user_list(name, user) if user else name

    def consumption_order(self) -> list[str]:
        """Every list of the queue, in the order a worker that consumes only this queue reads
        them (levels first, users in the order of :attr:`users`, kombu's step lists last): the
        order to take its next messages in."""
        return [key for key, _ in brpop_keys(leveled([self.queue]), self.users, self.steps)]

    def all(self) -> list[str]:
        """Every list of the queue (:meth:`consumption_order`)."""
        return self.consumption_order()

    def count(self, client: Any, level: Level | None = None, *, steps: bool = True) -> int:
        """Messages waiting in the queue (of ``level`` only, if given), one round trip; with
        ``steps`` (the default) kombu's step lists counted too."""
        names = self.of_level(level, steps=steps) if level is not None else [
            name for lvl in Level for name in self.of_level(lvl, steps=steps)]
        return sum(count_waiting(client, names))
