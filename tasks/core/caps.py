"""Caps: how many devices of each kind a user, or a team (a named set of users), holds at once.

An admin sets them fleet-wide, live (``devicefleet cap set alice gpu=4 --borrow``,
``devicefleet cap team ml alice bob``, ``devicefleet cap set --team ml gpu=6``): one Redis hash,
``keys.CAPS``, ``{"user:<name>" | "team:<name>": Cap JSON}``. A hash rather than a file the
workers read: a cap changes on a running fleet at once, on every host, with no restart, and the
take script that enforces it reads it where it runs.

The rule is checked where a lease is handed out, in the same script (:data:`tasks.core.jobscripts.TAKE`,
:data:`CAP_LUA`): no round trip of its own, and none at all for a fleet with no caps (one
``EXISTS`` inside the script). What a user holds is counted from the live leases
(``keys.LEASES`` records whose key is still there, each with its user and device), so a dead
worker's lease stops counting when its key expires, and a Redis restart's count comes back with
the leases the workers restore: there is no counter to leak or rebuild.

A job over a cap that does not borrow is refused its lease and goes back to its queue, to be
taken again :data:`~tasks.core.defaults.CAP_RETRY_S` later (:class:`tasks.worker.lease.Take`
``CAPPED``). A cap with ``borrow`` lets it run all the same, its lease marked ``borrowed``: such
work is preemptible by any waiting work (:mod:`tasks.worker.preemption`). Each grant to a capped
user or team is appended to ``keys.CAP_AUDIT`` with the count it made, by the script itself: an
audit of every instant, not a sample.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis
from kombu.utils.encoding import bytes_to_str
from pydantic import ConfigDict, Field, ValidationError

from . import keys
from .devices import DeviceKind
from .errors import CapError
from .priority import USER_PATTERN
from .records import LeaseRecord, _Record, stored

#: The device kinds a cap may name.
CAP_KINDS = tuple(kind.value for kind in DeviceKind)

USER_PREFIX = "user:"
TEAM_PREFIX = "team:"


class Cap(_Record):
    """A user's or team's cap (``keys.CAPS``): devices of each kind held at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: ``{kind: devices}``; a kind not named is not capped.
    limits: dict[str, int] = Field(default_factory=dict)
    #: Whether work over the cap may run on devices no one else wants, as preemptible work.
    borrow: bool = False
    #: A team's users (``None``: a user's cap).
    members: list[str] | None = None


class CapGrant(_Record):
    """One lease the take script granted to a capped user or team (``keys.CAP_AUDIT``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str
    #: ``user:<name>`` or ``team:<name>``.
    subject: str
    user: str
    kind: str
    device: str
    #: Devices of ``kind`` the subject held with this grant (its own included).
    count: int
    limit: int
    borrowed: bool
    #: Redis's time of the grant (epoch seconds).
    at: float


@dataclass(frozen=True)
class CapUse:
    """What a capped user or team holds now of one kind, against its cap."""

    subject: str
    kind: str
    held: int
    limit: int
    borrow: bool

    @property
    def name(self) -> str:
        """``alice``, or ``team ml``."""
        if self.subject.startswith(TEAM_PREFIX):
            return f"team {self.subject.removeprefix(TEAM_PREFIX)}"
        return self.subject.removeprefix(USER_PREFIX)

    @property
    def at_cap(self) -> bool:
        return self.held >= self.limit

    def line(self) -> str:
        """``alice: 4/4 gpu (cap), borrowing off``."""
        return (f"{self.name}: {self.held}/{self.limit} {self.kind}{' (cap)' if self.at_cap else ''}, "
                f"borrowing {'on' if self.borrow else 'off'}")

    def covers(self, caps: dict[str, Cap], user: str | None) -> bool:
        """Whether this cap counts ``user``'s devices."""
        if user is None:
            return False
        if self.subject == USER_PREFIX + user:
            return True
        cap = caps.get(self.subject)
        return cap is not None and cap.members is not None and user in cap.members


# -- what admins write -----------------------------------------------------------------------------


def _name(value: str, what: str) -> str:
    if not re.fullmatch(USER_PATTERN, value):
        raise CapError(f"cap: {what} {value!r} is not a valid name (letters, digits, _ . @ -; 64 at most)")
    return value


def parse_limits(items: list[str]) -> dict[str, int]:
    """``["gpu=4", "cpu=2"]`` as ``{"gpu": 4, "cpu": 2}``.

    Raises:
        CapError: an item is not ``kind=count``, names an unknown kind, or a count that is not
            a whole number of 0 or more; one line naming it.
    """
    limits: dict[str, int] = {}
    for item in items:
        kind, sep, count = item.partition("=")
        if not sep:
            raise CapError(f"cap: {item!r} is not kind=devices; write e.g. gpu=4")
        if kind not in CAP_KINDS:
            raise CapError(f"cap: unknown device kind {kind!r} in {item!r}; use {' or '.join(CAP_KINDS)}, e.g. gpu=4")
        if not re.fullmatch(r"\d{1,6}", count):
            raise CapError(f"cap: {item!r}: the devices must be a whole number of 0 or more (e.g. {kind}=4)")
        limits[kind] = int(count)
    return limits


def read_caps(client: redis.Redis) -> dict[str, Cap]:
    """``{subject: Cap}`` of every cap set (a record that does not parse is left out)."""
    caps: dict[str, Cap] = {}
    for subject, raw in client.hgetall(keys.CAPS).items():
        try:
            caps[bytes_to_str(subject)] = stored(Cap, raw)
        except ValidationError:
            continue
    return caps


def set_cap(client: redis.Redis, limits: dict[str, int], *, user: str | None = None, team: str | None = None,
            borrow: bool = False) -> Cap:
    """Set the cap of ``user`` or of ``team`` (whose members were named: :func:`set_team`),
    replacing its limits and borrowing. Returns it.

    Raises:
        CapError: neither or both named, a bad name, or an unknown team.
    """
    if (user is None) == (team is None):
        raise CapError("cap: name a user or a team (--team NAME), not both")
    if user is not None:
        subject = USER_PREFIX + _name(user, "user")
        members = None
    else:
        subject = TEAM_PREFIX + _name(str(team), "team")
        known = read_caps(client).get(subject)
        if known is None:
            raise CapError(f"cap: unknown team {team!r}; name its users first: devicefleet cap team {team} USER...")
        members = known.members
    cap = Cap(limits=limits, borrow=borrow, members=members)
    client.hset(keys.CAPS, subject, cap.to_json())
    return cap


def set_team(client: redis.Redis, team: str, members: list[str]) -> Cap:
    """Name ``team``'s users (its limits and borrowing kept, none at first). Returns it.

    Raises:
        CapError: a bad name, or no users.
    """
    subject = TEAM_PREFIX + _name(team, "team")
    if not members:
        raise CapError(f"cap: team {team!r} needs at least one user: devicefleet cap team {team} USER...")
    users = sorted({_name(member, "user") for member in members})
    known = read_caps(client).get(subject) or Cap()
    cap = known.model_copy(update={"members": users})
    client.hset(keys.CAPS, subject, cap.to_json())
    return cap


def remove_cap(client: redis.Redis, *, user: str | None = None, team: str | None = None) -> None:
    """Remove ``user``'s cap, or ``team`` with its cap.

    Raises:
        CapError: neither or both named, or no such cap.
    """
    if (user is None) == (team is None):
        raise CapError("cap: name a user or a team (--team NAME), not both")
    subject = USER_PREFIX + str(user) if user is not None else TEAM_PREFIX + str(team)
    if not client.hdel(keys.CAPS, subject):
        what = f"user {user!r}" if user is not None else f"team {team!r}"
        raise CapError(f"cap: {what} has no cap; devicefleet cap list shows those set")


# -- what the fleet holds against them -------------------------------------------------------------


def kind_of(device: str) -> str:
    """``cpu`` of ``cpu0`` (or ``cpu0@host``)."""
    match = re.match(r"[a-z]+", device)
    return match.group(0) if match else ""


def cap_uses(caps: dict[str, Cap], leases: list[LeaseRecord]) -> list[CapUse]:
    """Each cap's devices held now, per kind it names, from the live ``leases`` (pure: the rule
    the take script applies, :data:`CAP_LUA`)."""
    uses = []
    for subject, cap in sorted(caps.items()):
        users = set(cap.members) if cap.members is not None else {subject.removeprefix(USER_PREFIX)}
        for kind, limit in sorted(cap.limits.items()):
            held = sum(1 for lease in leases if lease.user in users and kind_of(lease.device) == kind)
            uses.append(CapUse(subject, kind, held, limit, cap.borrow))
    return uses


def live_leases(client: redis.Redis) -> list[LeaseRecord]:
    """The leases whose key is still there (a dead worker's expired one is not): one ``HGETALL``
    and one pipelined ``EXISTS`` per lease."""
    recorded = client.hgetall(keys.LEASES)
    if not recorded:
        return []
    ids = list(recorded)
    with client.pipeline(transaction=False) as pipe:
        for task_id in ids:
            pipe.exists(keys.lease(bytes_to_str(task_id)))
        alive = pipe.execute()
    out = []
    for task_id, exists in zip(ids, alive, strict=True):
        if not exists:
            continue
        try:
            out.append(stored(LeaseRecord, recorded[task_id]))
        except ValidationError:
            continue
    return out


def read_cap_uses(client: redis.Redis) -> tuple[dict[str, Cap], list[CapUse]]:
    """The caps set, and what each holds now (:func:`cap_uses` of :func:`live_leases`)."""
    caps = read_caps(client)
    return caps, cap_uses(caps, live_leases(client)) if caps else []


def blocking(caps: dict[str, Cap], uses: list[CapUse], user: str | None, kind: str) -> list[CapUse]:
    """The caps at their limit that hold ``user``'s next job of ``kind`` back (borrowing ones too)."""
    return [use for use in uses if use.kind == kind and use.at_cap and use.covers(caps, user)]


def read_audit(client: redis.Redis) -> list[CapGrant]:
    """The take script's grants to capped users and teams, oldest first (``keys.CAP_AUDIT``)."""
    return [stored(CapGrant, raw) for raw in client.lrange(keys.CAP_AUDIT, 0, -1)]


#: Lua functions of the take script's cap check (:data:`tasks.core.jobscripts.TAKE`).
#: ``cap_rules(caps_key, user, kind)``: the caps that count ``user``'s devices of ``kind``
#: (nothing read past one ``EXISTS`` when no cap is set). ``cap_count(rules, leases_key,
#: lease_prefix, kind, task_id)``: each rule's devices held, from the live leases (their key is
#: there) other than ``task_id``'s. ``cap_refused(rules, kind)``: the reason a cap that does not
#: borrow refuses the lease (false: none), and whether the grant is borrowed.
#: ``cap_audit(rules, audit_key, task_id, user, kind, device, borrowed)``: the grant appended.
CAP_LUA = """
local kind_of = function(device) return string.match(device or '', '^(%a+)') or '' end
local cap_rules = function(caps_key, user, kind)
  local rules = {}
  if user == '' or redis.call('exists', caps_key) == 0 then return rules end
  local all = redis.call('hgetall', caps_key)
  for i = 1, #all, 2 do
    local ok, cap = pcall(cjson.decode, all[i + 1])
    if ok and type(cap) == 'table' and type(cap.limits) == 'table' and tonumber(cap.limits[kind]) then
      local members = nil
      if all[i] == 'user:' .. user then
        members = {[user] = true}
      elseif string.sub(all[i], 1, 5) == 'team:' and type(cap.members) == 'table' then
        local set, mine = {}, false
        for _, name in ipairs(cap.members) do
          set[name] = true
          if name == user then mine = true end
        end
        if mine then members = set end
      end
      if members then
        rules[#rules + 1] = {subject = all[i], limit = tonumber(cap.limits[kind]), borrow = cap.borrow == true,
                             members = members, count = 0}
      end
    end
  end
  return rules
end
local cap_count = function(rules, leases_key, lease_prefix, kind, task_id)
  if #rules == 0 then return end
  local all = redis.call('hgetall', leases_key)
  for i = 1, #all, 2 do
    if all[i] ~= task_id and redis.call('exists', lease_prefix .. all[i]) == 1 then
      local ok, lease = pcall(cjson.decode, all[i + 1])
      if ok and type(lease) == 'table' and type(lease.user) == 'string' and kind_of(lease.device) == kind then
        for _, rule in ipairs(rules) do
          if rule.members[lease.user] then rule.count = rule.count + 1 end
        end
      end
    end
  end
end
local cap_name = function(subject)
  if string.sub(subject, 1, 5) == 'team:' then return 'team ' .. string.sub(subject, 6) end
  return string.sub(subject, 6)
end
local cap_refused = function(rules, kind)
  local borrowed = false
  for _, rule in ipairs(rules) do
    if rule.count >= rule.limit then
      if not rule.borrow then
        return cap_name(rule.subject) .. ': ' .. rule.count .. '/' .. rule.limit .. ' ' .. kind
          .. ' (cap), borrowing off', false
      end
      borrowed = true
    end
  end
  return false, borrowed
end
local cap_audit = function(rules, audit_key, keep, task_id, user, kind, device, borrowed)
  if #rules == 0 then return end
  local t = redis.call('time')
  local at = tonumber(t[1]) + tonumber(t[2]) / 1e6
  for _, rule in ipairs(rules) do
    redis.call('rpush', audit_key, cjson.encode({task_id = task_id, subject = rule.subject, user = user,
      kind = kind, device = device, count = rule.count + 1, limit = rule.limit, borrowed = borrowed, at = at}))
  end
  redis.call('ltrim', audit_key, -tonumber(keep), -1)
end
"""
