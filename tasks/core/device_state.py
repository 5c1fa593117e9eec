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
Every reader and writer goes through this module; the hash's layout is nowhere else: the fleet's
own writer, the black-hole rule (:func:`failed_fast`, called where a device worker decides a job's
end), is here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import redis
from kombu.utils.encoding import bytes_to_str
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


#: A job failed fast on a device: is the device a black hole, and what becomes of the job
#: (:mod:`tasks.worker.blackhole`; K: :data:`~tasks.core.defaults.BLACKHOLE_K`). KEYS:
#: ``keys.fast_failures(device)``, ``keys.failed_on(task_id)``, ``keys.DEVICE_STATE``,
#: ``keys.queue_ok(queue)`` of the shared queue it came from (its kind's, ``fleet``, a sweep's),
#: ``keys.fast_failure_errors(device)``; ARGV: task id, device, its error (one line), K, the window
#: in seconds, now (epoch seconds), the prefix of ``keys.fast_failures``.
#:
#: - failed on two devices: evidence against neither (taken out of every device's window) ->
#:   ``{'store', ''}``;
#: - else it joins the device's window of different jobs failed fast; at K of them, while another
#:   device ended a job of the same queue ok since the first of them, and the device in service, it is
#:   quarantined (``keys.DEVICE_STATE``, ``by`` fleet) with the jobs and their errors as reason;
#: - its first fast failure on this device -> ``{'again', reason}`` (back to its queue: a second
#:   one here is stored), else ``{'store', reason}``; ``reason``: the quarantine's, when this
#:   failure made it ('' otherwise).
FAILED_FAST = """
local device, job, now, window = ARGV[2], ARGV[1], tonumber(ARGV[6]), tonumber(ARGV[5])
local before = redis.call('hexists', KEYS[2], device) == 1
redis.call('hset', KEYS[2], device, ARGV[3])
redis.call('expire', KEYS[2], window)
local devices = redis.call('hkeys', KEYS[2])
if #devices >= 2 then
  for _, other in ipairs(devices) do redis.call('zrem', ARGV[7] .. other, job) end
  return {'store', ''}
end
redis.call('zadd', KEYS[1], now, job)
redis.call('zremrangebyscore', KEYS[1], '-inf', now - window)
redis.call('expire', KEYS[1], window)
redis.call('hset', KEYS[5], job, ARGV[3])
redis.call('expire', KEYS[5], window)
local reason = ''
local jobs = redis.call('zrange', KEYS[1], 0, -1, 'withscores')
if #jobs / 2 >= tonumber(ARGV[4]) and redis.call('hexists', KEYS[3], device) == 0 then
  local first = tonumber(jobs[2])
  local elsewhere = nil
  local last_ok = redis.call('hgetall', KEYS[4])  -- where the same queue's jobs ended ok lately
  for i = 1, #last_ok, 2 do
    if last_ok[i] ~= device and tonumber(last_ok[i + 1]) >= first then elsewhere = last_ok[i] end
  end
  if elsewhere then
    local evidence = {}
    for i = 1, #jobs, 2 do
      evidence[#evidence + 1] = jobs[i] .. ' (' .. (redis.call('hget', KEYS[5], jobs[i]) or '?') .. ')'
    end
    reason = 'black hole: ' .. (#jobs / 2) .. ' different jobs failed fast here while ' .. elsewhere ..
      ' ended jobs ok: ' .. table.concat(evidence, '; ')
    redis.call('hset', KEYS[3], device, cjson.encode({device = device, state = 'quarantined', reason = reason,
      since = now, by = 'fleet', hardware = false, now = false}))
  end
end
if not before then return {'again', reason} end
return {'store', reason}
"""


@dataclass(frozen=True)
class FastFailure:
    """What :data:`FAILED_FAST` decided: the job goes back to its queue (``again``) or its failure
    is stored; ``quarantined``: the reason of the device's quarantine this failure made ('' none)."""

    again: bool
    quarantined: str = ""


def failed_fast(client: redis.Redis, task_id: str, device: str, error: str, *, queue: str, now: float, k: int,
                window_s: int) -> FastFailure:
    """Job ``task_id`` of shared queue ``queue`` failed fast on ``device`` with ``error``
    (:data:`FAILED_FAST`, one script call): whether its failure is stored or it goes back to its
    queue, and the quarantine of the device this failure made, if it did."""
    reply = client.register_script(FAILED_FAST)(
        keys=[keys.fast_failures(device), keys.failed_on(task_id), keys.DEVICE_STATE, keys.queue_ok(queue),
              keys.fast_failure_errors(device)],
        args=[task_id, device, error, k, window_s, now, keys.FAST_FAILURES_PREFIX])
    return FastFailure(again=bytes_to_str(reply[0]) == "again", quarantined=bytes_to_str(reply[1]))


def redis_now(client: redis.Redis) -> float:
    """Redis' clock, so every writer's ``since`` is on one clock."""
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6
