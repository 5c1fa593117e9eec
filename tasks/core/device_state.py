"""A device's service state: the one owner of ``keys.DEVICE_STATE`` (issue 50).

A device is ``ok`` unless something took it out of service:

- ``drained``: by an operator (``devicefleet device drain``) or by its worker's health service on a
  fatal hardware event; it finishes its running job, takes nothing new, keeps its heartbeat;
- ``quarantined``: by the fleet, when different jobs fail fast on it while they succeed elsewhere
  (a black hole); the evidence is its reason;
- ``suspect``: by its worker's health service (an NVML call failed or hung): it takes nothing new
  until a probe clears it.

The state lives in one Redis hash with no TTL (it outlives a worker restart; a Redis restart keeps
it as far as the server persists), one JSON :class:`DeviceState` per device that is not ``ok``.
Every reader and writer goes through this module; the hash's layout is nowhere else.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import redis
from pydantic import BaseModel, ConfigDict

from . import keys
from .records import stored

#: The states a device can be in; ``ok`` is stored as no field at all.
Health = Literal["ok", "suspect", "drained", "quarantined"]
#: Every state, ``ok`` first (the exporter's gauge has one series per state).
STATES: tuple[str, ...] = get_args(Health)
#: The states in which a device takes no new work.
OUT_OF_SERVICE: frozenset[str] = frozenset({"suspect", "drained", "quarantined"})


class DeviceState(BaseModel):
    """Why a device is out of service, since when (Redis time, epoch seconds) and by whom."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str
    state: Health = "ok"
    reason: str = ""
    since: float = 0.0
    #: Who set it: an operator's name, ``"health"`` (its worker's health service) or ``"fleet"``.
    by: str = ""
    #: The state came from a hardware event: un-draining runs a short probe first.
    hardware: bool = False
    #: Drained ``--now``: its running jobs go back to their queue at once (no attempt spent)
    #: instead of finishing.
    now: bool = False

    @property
    def in_service(self) -> bool:
        return self.state not in OUT_OF_SERVICE


def _parse(device: str, raw: str | bytes | None) -> DeviceState:
    if raw is None:
        return DeviceState(device=device)
    return stored(DeviceState, raw)


def read_state(client: redis.Redis, device: str) -> DeviceState:
    """One device's state (``ok`` when nothing is stored)."""
    return _parse(device, client.hget(keys.DEVICE_STATE, device))


def read_states(client: redis.Redis) -> dict[str, DeviceState]:
    """Every device that is out of service (or was marked), by name."""
    return parse_states(client.hgetall(keys.DEVICE_STATE))


def parse_states(raw: dict[Any, Any]) -> dict[str, DeviceState]:
    """The states of an ``HGETALL`` of ``keys.DEVICE_STATE`` (read in a caller's pipeline)."""
    out: dict[str, DeviceState] = {}
    for name, value in raw.items():
        device = name.decode() if isinstance(name, bytes) else name
        out[device] = _parse(device, value)
    return out


def write_state(client: redis.Redis, state: DeviceState) -> None:
    """Store a device's state; ``ok`` removes its field."""
    if state.state == "ok":
        client.hdel(keys.DEVICE_STATE, state.device)
    else:
        client.hset(keys.DEVICE_STATE, state.device, state.model_dump_json())


def out_of_service(client: redis.Redis, devices: list[str]) -> dict[str, DeviceState]:
    """Of ``devices``, those out of service now, by name (one ``HMGET``)."""
    if not devices:
        return {}
    raw = client.hmget(keys.DEVICE_STATE, devices)
    states = (_parse(device, value) for device, value in zip(devices, raw, strict=True) if value is not None)
    return {state.device: state for state in states if not state.in_service}


#: Lua: ``out_of_service(key, device)``, the state (a string) of ``device`` when it takes no new
#: work, else false; ``key`` is ``keys.DEVICE_STATE``. For the scripts that decide whether a job
#: may start (:data:`tasks.core.jobscripts.TAKE`): the check costs no round trip of its own.
LUA_OUT_OF_SERVICE = """
local out_of_service = function(key, device)
  if key == '' or device == '' then return false end
  local raw = redis.call('hget', key, device)
  if not raw then return false end
  local ok, state = pcall(cjson.decode, raw)
  if ok and type(state) == 'table' and (OUT_STATES) then return state.state end
  return false
end
""".replace("OUT_STATES", " or ".join(f"state.state == '{name}'" for name in sorted(OUT_OF_SERVICE)))


def redis_now(client: redis.Redis) -> float:
    """Redis' clock, so every writer's ``since`` is on one clock."""
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6
