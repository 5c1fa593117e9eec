"""Who wants which devices, at what level, since when: one claim set for gangs and device groups.

Work that needs several devices at once, a distributed job's gang (:mod:`tasks.worker.gang`) or
a device group (:mod:`tasks.worker.group`), waits for them holding what it has: a gang's ranks
hold the devices they joined on, a group's leader holds its own and its keepers hold the others
for it. Each device has one sorted set of the claims on it (:func:`tasks.core.keys.device_claims`),
a :class:`Claim` each, scored by its :func:`~tasks.core.priority.precedence` (its job's level, then
its age: a ``seq`` from the one counter :data:`tasks.core.keys.CLAIM_SEQ`, so a gang and a group
sent one after the other are ordered by their sends). Each claim lives while its ``alive`` key
does (:attr:`Claim.alive`), which its waiters refresh: the claims of dead workers expire.

- a **gang** claims each device whose rank has not joined its current generation (its join
  script writes and drops them; a rank that gives its device up claims it again);
- a **group** claims every device while it waits and runs, from its send on (its producer
  reserves the devices but its leader's, its leader all of them as it takes the message), with
  the TTL and refresh of :mod:`tasks.core.group_reservation`; on a device its keeper closes the
  gate to single jobs and holds the device for the first group claim;
- a **sent** group also claims its leader's device (kind ``sent``) until its leader takes its
  message: that device's queue is first in, first out, so the claim closes no gate, but the
  work waiting in front of the message knows it is wanted there.

**The rule.** Work that has not started (a gang not assembled, a group not running) and finds,
on a device it waits on, a live claim of higher precedence (:func:`before`: a higher level,
whatever the ages; the same level and older) gives way: a gang's rank leaves its generation
(its claim on the device comes back) and a group's leader drops its reservation, and either's
message goes back to its queue (:class:`~tasks.core.errors.GiveWay`,
:data:`~tasks.core.defaults.GIVE_WAY_S` later). A rank looks at its own device, a leader at all
of its group's. A keeper whose device's first live claim is a gang's lets its hold go and opens
its gate (:mod:`tasks.worker.group`): the gang's rank there must get in; else it holds the device
for the first group. Work that has started never gives way (a device held for a group that runs
stays shut to its end).

**No deadlock.** Claims are totally ordered (levels, then a counter that never repeats) and a
claim's precedence never changes. Work waits only for claims before its own and for jobs that
run, which end; so no cycle of waits forms. The first live claim of all waits for nobody: every
device it wants is free, runs a job that ends, or is held by later work, which sees the claim
there and gives the device up (a rank on its device, a leader on any of its own, a keeper by
opening its gate to a gang or holding for the first group).

**No starvation.** A claim keeps its precedence across give-ways (its age is taken once, at the
send; a gang's or group's retry carries it), so each give-way is to earlier work, of which there
is a finite amount at any time of its own level or higher; single jobs sent after a group's send
wait at its gates (:mod:`tasks.worker.group`), and only work of a higher level overtakes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import redis

from . import keys
from .defaults import GROUP_NUDGE_TTL_MS
from .priority import Level, level_of
from .replies import text

logger = logging.getLogger(__name__)

Kind = Literal["gang", "group", "sent"]
GANG: Kind = "gang"
GROUP: Kind = "group"
SENT: Kind = "sent"


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim on a device: a ``gang`` (its id), a ``group``'s attempt, or a ``sent`` group's
    attempt on its leader's device; its :func:`~tasks.core.priority.precedence` (lower goes first)."""

    kind: Kind
    id: str
    precedence: float

    @property
    def member(self) -> str:
        """Its member in a device's claim set."""
        return member(self.kind, self.id)

    @property
    def alive(self) -> str:
        """The key that says its waiters are alive: gone, the claim is dead."""
        return keys.gang_alive(self.id) if self.kind == GANG else keys.group_alive(self.id)

    @property
    def level(self) -> Level:
        return level_of(self.precedence)

    def __str__(self) -> str:
        return self.id if self.kind == GANG else f"group {self.id}"

    @classmethod
    def parse(cls, raw: Any, score: float) -> Claim:
        kind, _, claim_id = text(raw).partition(":")
        if kind not in (GANG, GROUP, SENT):
            raise ValueError(f"not a claim: {text(raw)!r}")
        return cls(kind, claim_id, score)  # type: ignore[arg-type]


def member(kind: Kind, claim_id: str) -> str:
    """The member of ``kind``'s claim ``claim_id`` in a device's claim set (the scripts build
    the same: ``<kind>:<id>``)."""
    return f"{kind}:{claim_id}"


def nudge(pipe: Any, *devices: str) -> Any:
    """Queue on ``pipe`` (a pipeline or a client) the nudges that wake the keepers of
    ``devices``: whatever changes a device's claims sends one (:func:`tasks.core.keys.group_nudge`).
    Returns ``pipe``."""
    for device in devices:
        pipe.rpush(keys.group_nudge(device), 1)
        pipe.pexpire(keys.group_nudge(device), GROUP_NUDGE_TTL_MS)
    return pipe


def _alive(client: redis.Redis, found: Sequence[Claim]) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for claim in found:
        pipe.exists(claim.alive)
    return [bool(n) for n in pipe.execute()] if found else []


def live(client: redis.Redis, device: str, entries: Iterable[tuple[Any, float]]) -> list[Claim]:
    """The live claims of ``entries`` (``device``'s claim set, read with its scores), first in
    precedence first; the dead ones (their ``alive`` key gone) are dropped from the set."""
    found = sorted((Claim.parse(raw, score) for raw, score in entries), key=lambda c: (c.precedence, c.member))
    up = _alive(client, found)
    dead = [claim.member for claim, alive in zip(found, up, strict=True) if not alive]
    if dead:
        logger.info("%s: dropping the claims of %s: their workers are gone", device, ", ".join(dead))
        client.zrem(keys.device_claims(device), *dead)
    return [claim for claim, alive in zip(found, up, strict=True) if alive]


def read_before(pipe: Any, device: str, precedence: float) -> None:
    """Queue on ``pipe`` the read of ``device``'s claims before ``precedence``, with their
    scores (for :func:`before`)."""
    pipe.zrangebyscore(keys.device_claims(device), "-inf", f"({precedence}", withscores=True)


def before(client: redis.Redis, found: Iterable[tuple[str, Iterable[tuple[Any, float]]]]) -> tuple[str, Claim] | None:
    """The rule: of ``found`` (``(device, claims before some work's precedence)`` pairs, as
    :func:`read_before` read them), the first live claim and its device, which that work gives
    way to; None when none is live (then it waits on)."""
    claims = sorted(((Claim.parse(raw, score), device) for device, entries in found for raw, score in entries),
                    key=lambda cd: (cd[0].precedence, cd[0].member))
    for (claim, device), up in zip(claims, _alive(client, [c for c, _ in claims]), strict=True):
        if up:
            return device, claim
    return None


def groups_on(client: redis.Redis, devices: Iterable[str], *, sent: bool = False) -> list[str]:
    """The group attempts that claim any of ``devices`` (those a ``sent`` claim names too, if
    ``sent``), first in precedence first, each once."""
    pipe = client.pipeline(transaction=False)
    for device in devices:
        pipe.zrange(keys.device_claims(device), 0, -1, withscores=True)
    kinds = (GROUP, SENT) if sent else (GROUP,)
    claims = sorted((Claim.parse(raw, score) for found in pipe.execute() for raw, score in found),
                    key=lambda c: c.precedence)
    return list(dict.fromkeys(c.id for c in claims if c.kind in kinds))
