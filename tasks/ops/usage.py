"""``devicefleet usage``: what each user, and each team, held of the fleet and how busy they kept it.

Read from the figures the store script adds at each job's end, in the call it makes anyway
(:data:`tasks.core.fairshare.USAGE_LUA`, beside the fair share's ``keys.USAGE`` and
``keys.USER_SECONDS``): per user and device kind, ever (``keys.USAGE_TOTALS``) and per hour a job
ended in (``keys.usage_day``, one hash a day, kept
:data:`~tasks.core.defaults.USAGE_KEEP_DAYS` days), the device-seconds held (its run, a pack member's share of it) and, where measured, the
device-seconds it kept the device busy. On a CPU device busy is its job process's CPU seconds
(and its reaped children's) over the cores it ran on, measured by the worker; on a GPU it is not
measured yet (``busy`` is ``None`` there: no figure rather than a wrong one). Held idle is held
less busy. A team is the users a cap names as one (:mod:`tasks.core.caps`). A job counts in the
hour it ended, so ``--since`` is exact to the hour.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass

import redis
from kombu.utils.encoding import bytes_to_str

from ..core import keys
from ..core.caps import TEAM_PREFIX, read_caps
from ..core.defaults import USAGE_KEEP_DAYS
from ..core.errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """``7d`` as seconds (``s``, ``m``, ``h``, ``d``, ``w``).

    Raises:
        ConfigError: not a number and one of those units; one line naming it.
    """
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not match:
        raise ConfigError(f"--since {text!r}: write a number and a unit (s, m, h, d, w), e.g. 7d or 12h")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Usage:
    """What one user (or team) held of one kind of device over the period."""

    #: ``alice``, or ``team ml``.
    name: str
    kind: str
    held_s: float
    #: Device-seconds kept busy where measured (CPU devices); None where not (GPUs).
    busy_s: float | None

    @property
    def busy_fraction(self) -> float | None:
        if self.busy_s is None or self.held_s <= 0:
            return None
        return min(1.0, self.busy_s / self.held_s)

    @property
    def idle_s(self) -> float | None:
        """Held idle: held less busy (None where busy is not measured)."""
        return None if self.busy_s is None else max(0.0, self.held_s - self.busy_s)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind, "device_hours": self.held_s / 3600,
                "busy_fraction": self.busy_fraction,
                "held_idle_hours": None if self.idle_s is None else self.idle_s / 3600}


def usage_from(hours: dict[str, float], teams: dict[str, list[str]], since: float | None) -> list[Usage]:
    """Each user's, then each team's, :class:`Usage` per kind from the fields of ``keys.usage_day``
    hashes (``"<hour> <user> <kind> held|busy"``) of the hours that end after ``since``, or,
    with ``since`` None, from ``keys.USAGE_TOTALS``'s (``"<user> <kind> held|busy"``) (pure)."""
    held: dict[tuple[str, str], float] = defaultdict(float)
    busy: dict[tuple[str, str], float] = {}
    for field, seconds in hours.items():
        parts = field.split(" ")
        if since is not None:
            if len(parts) != 4 or not parts[0].isdigit() or int(parts[0]) + 3600 <= since:
                continue
            parts = parts[1:]
        if len(parts) != 3:
            continue
        user, kind, what = parts
        if what == "held":
            held[user, kind] += seconds
        elif what == "busy":
            busy[user, kind] = busy.get((user, kind), 0.0) + seconds
    rows = [Usage(user, kind, seconds, busy.get((user, kind))) for (user, kind), seconds in sorted(held.items())]
    for team, members in sorted(teams.items()):
        for kind in sorted({kind for _, kind in held}):
            mine = [(u, k) for (u, k) in held if k == kind and u in members]
            if not mine:
                continue
            measured = [busy[pair] for pair in mine if pair in busy]
            rows.append(Usage(f"team {team}", kind, sum(held[pair] for pair in mine),
                              sum(measured) if measured else None))
    return rows


def read_usage_hours(client: redis.Redis, since: float | None, now: float) -> dict[str, float]:
    """The fields of the days' hashes from ``since`` to ``now`` (one pipelined ``HGETALL`` a
    day), or of ``keys.USAGE_TOTALS`` with ``since`` None (one ``HGETALL``)."""
    if since is None:
        return {bytes_to_str(f): float(v) for f, v in client.hgetall(keys.USAGE_TOTALS).items()}
    first = max(int(since // 86400), int(now // 86400) - USAGE_KEEP_DAYS)
    with client.pipeline(transaction=False) as pipe:
        for day in range(first, int(now // 86400) + 1):
            pipe.hgetall(keys.usage_day(day))
        days = pipe.execute()
    return {bytes_to_str(f): float(v) for fields in days for f, v in fields.items()}


def read_teams(client: redis.Redis) -> dict[str, list[str]]:
    """``{team: users}`` of the teams named for caps."""
    return {subject.removeprefix(TEAM_PREFIX): cap.members for subject, cap in read_caps(client).items()
            if subject.startswith(TEAM_PREFIX) and cap.members is not None}


def read_fleet_usage(client: redis.Redis, since_s: float | None = None, now: float | None = None) -> list[Usage]:
    """What each user and team held over the last ``since_s`` seconds (None: ever)."""
    now = time.time() if now is None else now
    since = now - since_s if since_s is not None else None
    return usage_from(read_usage_hours(client, since, now), read_teams(client), since)


def usage_lines(rows: list[Usage]) -> list[str]:
    """``alice  cpu  1.25 device-h held, busy 62%, 0.47 h held idle`` per row."""
    lines = []
    for row in rows:
        fraction = row.busy_fraction
        busy = "busy not measured (GPU)" if fraction is None else f"busy {fraction:.0%}"
        idle = "" if row.idle_s is None else f", {row.idle_s / 3600:.2f} h held idle"
        lines.append(f"{row.name}: {row.held_s / 3600:.2f} {row.kind} device-h held, {busy}{idle}")
    return lines
