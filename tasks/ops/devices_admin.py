"""``devicefleet device drain | undrain | list``: an operator takes a device out of service and
back (issue 50); the state itself is :mod:`tasks.core.device_state`'s, obeyed by the device's
worker (:mod:`tasks.worker.service`) and by every fan-out (a device out of service is missing).

Un-draining a device whose state came from a hardware event (``hardware=True``: its health
service drained it, or it is suspect) runs a short probe first: the device is put back in
service, the built-in ``probe`` job (a few matrix products on the device, :data:`PROBE_KWARGS`)
is sent to it by name and must end ok within :data:`~tasks.core.defaults.UNDRAIN_PROBE_TIMEOUT_S`;
otherwise its former state comes back, with the probe's error added to its reason. While the
probe runs (well under a second on a healthy device) the device may also take a waiting job of a
shared queue: the probe proves the device runs a job, not that the job it took will succeed.

On a fleet with replicas (Sentinel) a state written here waits for them, as the fleet's other
writes that must outlive a failover do (:class:`~tasks.core.sentinel.Replication`, given as
``replication``): a drain the primary took just before it died is on the promoted replica, so
the device stays drained. One no replica had in time is logged as unconfirmed.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from ..core.defaults import UNDRAIN_PROBE_TIMEOUT_S
from ..core.device_state import DeviceState, read_state, read_states, redis_now, write_state
from ..core.errors import UnknownDevice
from ..core.priority import os_user
from ..core.registry import live_workers
from ..core.sentinel import Replication

#: The probe's job and kwargs: a tiny compute job on the device (a 64x64 matrix product loop for
#: 50 ms), through the fleet's whole path (queue, worker, job process, device, result).
PROBE_JOB = "probe"
PROBE_KWARGS: dict[str, Any] = {"busy_s": 0.05, "mode": "compute", "size": 64}


def known_devices(client: redis.Redis) -> list[str]:
    """The devices an operator may name: every live worker's, and every one with a stored state."""
    return sorted(set(live_workers(client)) | set(read_states(client)))


def _check_known(client: redis.Redis, device: str) -> None:
    known = known_devices(client)
    if device not in known:
        raise UnknownDevice(device, known, "no live worker has it and it has no stored state")


def _store(client: redis.Redis, state: DeviceState, replication: Replication | None) -> None:
    """Write ``state``, then wait for ``replication``'s replicas to have it (see the module)."""
    write_state(client, state)
    if replication is not None:
        replication.wait(client, f"{state.device}'s state {state.state}")


def drain(client: redis.Redis, device: str, reason: str, *, now: bool = False, by: str | None = None,
          replication: Replication | None = None) -> DeviceState:
    """Take ``device`` out of service: its worker finishes its running jobs (``now``: hands them
    back to their queue, no attempt spent) and takes nothing new; fan-outs treat it as missing.
    ``replication``: the replicas the state waits for (the fleet's: ``Settings.replication``)."""
    _check_known(client, device)
    state = DeviceState(device=device, state="drained", reason=reason, since=redis_now(client), by=by or os_user(),
                        now=now)
    _store(client, state, replication)
    return state


def undrain(client: redis.Redis, device: str, *, by: str | None = None, app: Any = None,
            timeout_s: float = UNDRAIN_PROBE_TIMEOUT_S, replication: Replication | None = None) -> DeviceState:
    """Put ``device`` back in service; after a hardware state, only once the probe passed (see
    the module). Returns its state now (``ok``, or its former state when the probe failed).

    Raises:
        UnknownDevice: ``device`` is unknown, or is in service already.
    """
    _check_known(client, device)
    former = read_state(client, device)
    if former.in_service:
        out = sorted(name for name, state in read_states(client).items() if not state.in_service)
        raise UnknownDevice(device, out, "it is not out of service", choices="devices out of service")
    _store(client, DeviceState(device=device), replication)
    if not former.hardware:
        return read_state(client, device)
    problem = probe(device, app, timeout_s)
    if problem is None:
        return read_state(client, device)
    failed = former.model_copy(update={"reason": f"{former.reason}; un-drain probe by {by or os_user()} failed: "
                                                 f"{problem}", "since": redis_now(client)})
    _store(client, failed, replication)
    return failed


def probe(device: str, app: Any = None, timeout_s: float = UNDRAIN_PROBE_TIMEOUT_S) -> str | None:
    """Run the probe job on ``device`` through ``app`` (default ``tasks.app``); ``None`` when
    it ended ok, else what went wrong."""
    from ..producer.fanout import fan_out

    started = time.monotonic()
    try:
        handle = fan_out(PROBE_JOB, devices=[device], kwargs=PROBE_KWARGS, priority="urgent", app=app)
        entry = handle.get(timeout=timeout_s).get(device) or {}
    except Exception as exc:  # noqa: BLE001  (every failure of the probe is the answer)
        return f"{type(exc).__name__}: {exc} after {time.monotonic() - started:.1f} s"
    error = entry.get("error")
    if error:
        return f"{error.get('type', 'error')}: {error.get('message', '')}" if isinstance(error, dict) else str(error)
    return None


def listing(client: redis.Redis) -> list[dict[str, Any]]:
    """Every known device's state, as rows for ``device list`` (and its ``--json``)."""
    live = live_workers(client)
    states = read_states(client)
    rows = []
    for device in sorted(set(live) | set(states)):
        state = states.get(device, DeviceState(device=device))
        rows.append({**state.model_dump(), "live": device in live})
    return rows
