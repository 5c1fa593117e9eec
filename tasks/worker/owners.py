"""Which warm job process may run a job: each belongs to the user of the first job it ran.

A job process runs many jobs (that is the fleet's speed: no torch import per job), so whatever a
job leaves in it (a module global, a cached dataset, a tokenizer's state) is there for the next
job it runs. A process therefore belongs to the user of its first job (its *owner*) and never
runs another user's: a job takes a warm process of its own user, else an unowned spare (which
becomes its user's), else waits for a fresh one. :class:`tasks.worker.pool.ProcessPool`
keeps the pool; these are its choices, pure, so that they are tested apart from processes.

Owners are user names as the job's options carry them (``JobOptions.user``); a job sent with
none belongs to :data:`LOCAL`, the fleet's one local user.

Under job accounts (:mod:`tasks.core.accounts`) a process starts as its user's system account,
so it is its user's from the start and no spare is anyone's: :func:`plan_accounts_spawn` chooses
whose process starts next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from ..core.wire import RunJob

#: The owner of a job that names no user: the fleet's one local user (an embedded ``up``).
LOCAL = ""


class Owned(Protocol):
    """A job process as these choices see it."""

    #: The user of the first job it ran; None: it ran none yet (a spare anyone may take).
    owner: str | None


P = TypeVar("P", bound=Owned)


def owner_of(job: RunJob) -> str:
    """The user ``job`` runs for (:data:`LOCAL` when it names none)."""
    user = job.options.get("user") if isinstance(job.options, dict) else None
    return user if isinstance(user, str) and user else LOCAL


def pack_owner(members: Sequence[RunJob]) -> str:
    """The one user of a pack's ``members``.

    Raises:
        ValueError: they are not all one user's (a pack's leader takes only its own user's
            trials: :class:`tasks.worker.modes.pack.Pack`).
    """
    owners = {owner_of(member) for member in members}
    if len(owners) != 1:
        raise ValueError(f"a pack mixes the jobs of users {sorted(owners)}: one process runs one user's jobs")
    return owners.pop()


def pick(idle: Sequence[P], owner: str) -> P | None:
    """The idle process a job of ``owner`` takes: the first of ``owner``'s own (``idle`` lists
    the most recently used first: its caches are hot), else the first unowned spare; None: it
    must wait for a fresh one."""
    spare = None
    for process in idle:
        if process.owner == owner:
            return process
        if process.owner is None and spare is None:
            spare = process
    return spare


def spares(idle: Sequence[Owned]) -> int:
    """How many of ``idle`` are unowned (any user's job may take them)."""
    return sum(1 for process in idle if process.owner is None)


def victim(idle: Sequence[P]) -> P | None:
    """The process to retire to make room for a fresh spare: the least recently used owned
    one (``idle`` lists the most recently used first); None: there is none idle."""
    for process in reversed(idle):
        if process.owner is not None:
            return process
    return None


class Counted(Owned, Protocol):
    """A job process as the choices under job accounts see it."""

    #: Jobs it ran: 0 for a fresh one.
    jobs_run: int


C = TypeVar("C", bound=Counted)


def plan_accounts_spawn(idle: Sequence[C], busy: int, spawning: Sequence[str], waiting: Mapping[str, int],
                        last: str, warm: int, most: int, spares: int) -> tuple[str, C | None] | None:
    """Under job accounts (:mod:`tasks.core.accounts`) the next process to start, as
    ``(owner, idle process to retire first or None)``; None: none now.

    A process starts as its user's system account and can never serve another user, so no
    spare is anyone's: a job ``waiting`` for a user with no process gets one started for that
    user first (``spawning`` lists the owners of the processes starting); else the user of the
    ``last`` job keeps ``spares`` fresh processes (their next job starts at once) and the
    device ``warm`` ones. Past ``most`` alive, the least recently used idle process goes, but not
    a fresh one of the user the new one is for (``idle`` lists the most recently used first).
    """
    alive = len(idle) + busy + len(spawning)
    owner = next((user for user, count in waiting.items() if count > spawning.count(user)), None)
    if owner is None:
        fresh = sum(1 for process in idle if process.owner == last and process.jobs_run == 0)
        if alive >= warm and fresh + spawning.count(last) >= spares:
            return None
        owner = last
    if alive < most:
        return owner, None
    old = next((process for process in reversed(idle)
                if not (process.owner == owner and process.jobs_run == 0)), None)
    return None if old is None else (owner, old)
