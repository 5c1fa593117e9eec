"""A GPU worker's health service: NVML's events and counters, judged, and the device's state set.

Beside the heartbeat, one thread of its own (``devicefleet-health``) waits for NVML's events (Xid
critical errors, single- and double-bit ECC errors: ``nvmlEventSetCreate``,
``nvmlDeviceRegisterEvents``, ``nvmlEventSetWait``) and every :data:`HEALTH_POLL_S` reads the
GPU's counters (volatile uncorrected ECC errors, retired pages pending, remapped rows pending or
failed, the GPU's recovery action). Each verdict is one of three actions:

- ``watch``: logged and counted (an Xid that is the application's own error: the job that made
  it fails as any job does, the device is fine);
- ``suspect``: an NVML call failed (any error but ``NotSupported``: fail closed) or hung; the
  device takes no new work until a probe clears it;
- ``drain``: a fatal hardware event; the device is drained (``by="health"``, ``hardware=True``)
  and the job running on it ends as a device failure (:class:`~tasks.core.errors.DeviceFailed`:
  back to its shared queue without spending an attempt, or its entry at once if it was sent to
  this device by name: :func:`tasks.worker.disposition.settle`).

A state is only ever raised here (ok < suspect < drained): an operator's undrain (after its
probe) is what lowers it. Every Xid is counted in ``keys.XID_COUNTS`` (the exporter's
``devicefleet_device_xid_total``).

Every NVML call runs on one more thread, the NVML thread, under a watchdog (:class:`NvmlCaller`):
the health thread waits for it at most :data:`HEALTH_NVML_TIMEOUT_S`; a call that does not return
by then marks the device suspect, and later calls are refused at once until it returns. The
heartbeat and the lease keeper share no thread and no lock with either (only the Redis client's
connection pool, which a hung NVML call never holds).

The Xid table follows NVIDIA's Xid catalogue (https://docs.nvidia.com/deploy/xid-errors/
analyzing-xid-catalog.html: each Xid's "resolution bucket"; RESTART_APP is the application's, a
GPU reset, node reboot or hardware inspection is the device's) and NVIDIA's page retirement notes
(https://docs.nvidia.com/deploy/dynamic-page-retirement/visibility.html: Xid 48, 63, 64).

The service runs on a GPU worker (its GPU's NVML index), or on a worker whose config names an
NVML index (``health_nvml_index``: how the tests drive a CPU worker with a fake ``pynvml``); a
CPU worker without one, or a host without ``nvidia-ml-py``, runs none.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis

from ..core.defaults import HEALTH_EVENT_WAIT_S, HEALTH_NVML_TIMEOUT_S, HEALTH_POLL_S
from ..core.device_state import DeviceState, read_state, redis_now, write_state
from ..core.xids import count_xid

logger = logging.getLogger(__name__)


class Action(str, Enum):
    """What a health verdict does to the device (in rising order)."""

    WATCH = "watch"
    SUSPECT = "suspect"
    DRAIN = "drain"


#: The device state each action raises the device to (``watch`` leaves it as it is).
_STATE_OF = {Action.SUSPECT: "suspect", Action.DRAIN: "drained"}
#: The order of the states a verdict may raise (quarantine is the fleet's: as high as a drain).
_RANK = {"ok": 0, "suspect": 1, "drained": 2, "quarantined": 2}


@dataclass(frozen=True)
class Verdict:
    """What one event or reading says about the device: its action and a one-line reason."""

    action: Action
    reason: str
    xid: int | None = None


#: Xid -> (action, what it is). The application's own errors are watched: the job that made
#: them fails like any failing job, and a device that only ever fails jobs is the black-hole
#: detector's business. The rest are the GPU's (NVIDIA: reset the GPU, reboot, inspect).
XIDS: dict[int, tuple[Action, str]] = {
    13: (Action.WATCH, "graphics engine exception (the application's own error)"),
    31: (Action.WATCH, "GPU memory page fault (the application's own illegal address)"),
    43: (Action.WATCH, "GPU stopped processing (the application's own error)"),
    45: (Action.WATCH, "preemptive cleanup after an earlier error"),
    46: (Action.DRAIN, "GPU stopped processing"),
    48: (Action.DRAIN, "double-bit ECC error"),
    62: (Action.DRAIN, "internal micro-controller halt"),
    63: (Action.DRAIN, "ECC page retirement or row remapping recorded: reset the GPU"),
    64: (Action.DRAIN, "ECC page retirement or row remapping failed"),
    74: (Action.DRAIN, "NVLink error"),
    79: (Action.DRAIN, "GPU has fallen off the bus"),
    92: (Action.DRAIN, "high single-bit ECC error rate"),
    94: (Action.DRAIN, "contained ECC error"),
    95: (Action.DRAIN, "uncontained ECC error"),
    119: (Action.DRAIN, "GSP RPC timeout"),
    120: (Action.DRAIN, "GSP error"),
}


def classify_xid(xid: int) -> Verdict:
    """The verdict of Xid ``xid``; one outside the table is watched (counted and logged: most
    Xids NVIDIA lists are the application's, or follow another one that is in the table)."""
    action, what = XIDS.get(xid, (Action.WATCH, "not in devicefleet's table: watched"))
    return Verdict(action, f"Xid {xid}: {what}", xid=xid)


def classify_nvml_error(call: str, exc: BaseException, nvml: Any) -> Verdict | None:
    """The verdict of NVML call ``call`` failing with ``exc``: none for ``NotSupported`` (the GPU
    has no such counter), a drain for a lost GPU, else suspect (fail closed)."""
    if isinstance(exc, getattr(nvml, "NVMLError_NotSupported", ())):
        return None
    if isinstance(exc, getattr(nvml, "NVMLError_GpuIsLost", ())):
        return Verdict(Action.DRAIN, f"NVML {call}: the GPU is lost ({exc})")
    return Verdict(Action.SUSPECT, f"NVML {call} failed: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Reading:
    """The GPU's counters at one periodic read; None: not supported on this GPU."""

    ecc_uncorrected: int | None = None
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    #: ``NVML_GPU_RECOVERY_ACTION_*``: 0 is none.
    recovery_action: int | None = None


#: NVML's field id of the GPU's recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, nvml.h),
#: which older nvidia-ml-py releases do not name (12.535.133, the floor); a driver without the
#: field says so in the value's own return code, read as "no action known".
RECOVERY_ACTION_FIELD = 271
#: ``NVML_GPU_RECOVERY_ACTION_*`` values and what the GPU asks for.
RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 3: "a drain and reset", 4: "a drain of P2P traffic",
                    5: "a bus reset", 6: "a system reboot", 7: "an IMEX domain recovery"}


def judge_reading(reading: Reading, first: Reading) -> Verdict | None:
    """The verdict of a periodic read (``first``: the service's first, the baseline of the
    counters): a drain when the GPU has new uncorrected ECC errors, pages or rows waiting for a
    reset, a failed remap, or asks for a recovery action; None when it is fine."""
    if reading.remap_failed:
        return Verdict(Action.DRAIN, "row remapping failed: the GPU needs service")
    if reading.recovery_action:
        what = RECOVERY_ACTIONS.get(reading.recovery_action, f"recovery action {reading.recovery_action}")
        return Verdict(Action.DRAIN, f"the GPU asks for {what}")
    if reading.ecc_uncorrected is not None and reading.ecc_uncorrected > (first.ecc_uncorrected or 0):
        new = reading.ecc_uncorrected - (first.ecc_uncorrected or 0)
        return Verdict(Action.DRAIN, f"{new} new uncorrected ECC error(s)")
    if reading.remap_pending:
        return Verdict(Action.DRAIN, "a row remapping is pending: reset the GPU")
    if reading.retired_pending:
        return Verdict(Action.DRAIN, "a page retirement is pending: reset the GPU")
    return None


class NvmlHung(Exception):
    """An NVML call did not return within the watchdog's timeout (or one before it still hangs)."""


class NvmlCaller:
    """Runs NVML calls on one thread of its own (the watchdog's subject); the caller waits at
    most ``timeout_s`` for each. A call that hangs keeps the thread: every later call is refused
    at once (:class:`NvmlHung`) until it returns, so hung calls never pile up threads."""

    def __init__(self, timeout_s: float = HEALTH_NVML_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._hung: _Call | None = None
        self._thread = threading.Thread(target=self._serve, name="devicefleet-nvml", daemon=True)
        self._thread.start()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, extra_s: float = 0.0) -> Any:
        """``fn(*args)``'s value, or its exception.

        Raises:
            NvmlHung: it did not return within ``timeout_s + extra_s`` (or an earlier call still
                hangs); it keeps running on the NVML thread.
        """
        hung = self._hung
        if hung is not None and not hung.done.is_set():
            raise NvmlHung(f"NVML {hung.name} has not returned yet")
        call = _Call(name, fn, args)
        self._calls.put(call)
        if not call.done.wait(self.timeout_s + extra_s):
            self._hung = call
            raise NvmlHung(f"NVML {name} did not return within {self.timeout_s + extra_s:g} s")
        if call.error is not None:
            raise call.error
        return call.value

    def close(self) -> None:
        self._calls.put(None)  # a hung call keeps its (daemon) thread: nothing waits for it

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call.value = call.fn(*call.args)
            except BaseException as exc:  # noqa: BLE001  (NVML's errors are its own classes)
                call.error = exc
            call.done.set()


class _Call:
    def __init__(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.name, self.fn, self.args = name, fn, args
        self.sent = time.monotonic()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class HealthService:
    """One GPU's health service (see the module's docstring): started and stopped by the worker's
    health step; :attr:`failed` tells the running job's watch that its device failed."""

    def __init__(self, client: redis.Redis, device: str, nvml: Any, index: int, *, uuid: str | None = None,
                 timeout_s: float = HEALTH_NVML_TIMEOUT_S, event_wait_s: float = HEALTH_EVENT_WAIT_S,
                 poll_s: float = HEALTH_POLL_S) -> None:
        self.client = client
        self.device = device
        self.nvml = nvml
        self.index = index
        #: The GPU's UUID as its job processes see it: NVML's index order may not be CUDA's.
        self.uuid = uuid
        self.event_wait_s = event_wait_s
        self.poll_s = poll_s
        self.caller = NvmlCaller(timeout_s)
        #: The first fatal verdict (a drain); None while the device is fine.
        self.failed: Verdict | None = None
        #: Every verdict but a fine reading, in order (what the tests and the log read).
        self.verdicts: list[Verdict] = []
        #: Called once, from the health thread, when the device first fails (the worker stops
        #: taking work from its shared queues: :class:`tasks.worker.steps.HealthStep`).
        self.on_failed: Callable[[Verdict], None] | None = None
        #: Set once the health thread has asked NVML for its events (whether it gives them or not).
        self.watching = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devicefleet-health", daemon=True)
        self._handle: Any = None
        self._events: Any = None
        self._first: Reading | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching: the health thread ends within its current event wait (a hung NVML
        call holds the NVML thread, which nothing waits for)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(2 * self.event_wait_s)
        self.caller.close()

    # -- the health thread -----------------------------------------------------------------------

    def _run(self) -> None:
        if not self._nvml("nvmlInit", self.nvml.nvmlInit):
            return
        self._handle = self._open()
        if self._handle is None:
            return
        self._events = self._register_events()
        self.watching.set()
        next_poll = time.monotonic()
        while not self._stopped.is_set():
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + self.poll_s
            if self._events is not None:
                self._wait_event()
            else:
                self._stopped.wait(min(self.event_wait_s, max(0.0, next_poll - time.monotonic())))

    def _open(self) -> Any:
        """The GPU's NVML handle, by its UUID where known (else NVML's index); None: judged."""
        if self.uuid:
            try:
                return self.caller.call("nvmlDeviceGetHandleByUUID", self.nvml.nvmlDeviceGetHandleByUUID, self.uuid)
            except NvmlHung as exc:
                self.judge(Verdict(Action.SUSPECT, f"{exc}: the NVML watchdog gave up on it"))
                return None
            except Exception as exc:  # noqa: BLE001  (a UUID in another spelling: the index then)
                logger.warning("%s: NVML does not know GPU %s (%s); watching NVML's GPU %d", self.device, self.uuid,
                               exc, self.index)
        return self._nvml("nvmlDeviceGetHandleByIndex", self.nvml.nvmlDeviceGetHandleByIndex, self.index)

    def _nvml(self, name: str, fn: Callable[..., Any], *args: Any, extra_s: float = 0.0) -> Any:
        """``fn(*args)`` through the watchdog; a failure or hang judged (its value None then).
        After a hang, waits a beat before the next call (it would be refused at once)."""
        try:
            value = self.caller.call(name, fn, *args, extra_s=extra_s)
            return value if value is not None else True
        except NvmlHung as exc:
            self.judge(Verdict(Action.SUSPECT, f"{exc}: the NVML watchdog gave up on it"))
            self._stopped.wait(self.event_wait_s)
        except Exception as exc:  # noqa: BLE001  (NVMLError_*)
            if (verdict := classify_nvml_error(name, exc, self.nvml)) is not None:
                self.judge(verdict)
        return None

    def _register_events(self) -> Any:
        nvml = self.nvml
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError | \
            nvml.nvmlEventTypeSingleBitEccError
        supported = self._nvml("nvmlDeviceGetSupportedEventTypes", nvml.nvmlDeviceGetSupportedEventTypes,
                               self._handle)
        if not supported or not (mask := int(supported) & wanted):
            logger.warning("%s: NVML gives no Xid or ECC events here; the health service reads counters only",
                           self.device)
            return None
        events = self._nvml("nvmlEventSetCreate", nvml.nvmlEventSetCreate)
        if events is None:
            return None
        if self._nvml("nvmlDeviceRegisterEvents", nvml.nvmlDeviceRegisterEvents, self._handle, mask, events) is None:
            return None
        return events

    def _wait_event(self) -> None:
        nvml = self.nvml
        try:
            data = self.caller.call("nvmlEventSetWait", nvml.nvmlEventSetWait, self._events,
                                    int(self.event_wait_s * 1000), extra_s=self.event_wait_s)
        except NvmlHung as exc:
            self.judge(Verdict(Action.SUSPECT, f"{exc}: the NVML watchdog gave up on it"))
            self._stopped.wait(self.event_wait_s)
            return
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, getattr(nvml, "NVMLError_Timeout", ())):
                return  # no event within the wait
            if (verdict := classify_nvml_error("nvmlEventSetWait", exc, nvml)) is not None:
                self.judge(verdict)
                self._stopped.wait(self.event_wait_s)
            return
        self.judge(self.event_verdict(int(data.eventType), int(data.eventData)))

    def event_verdict(self, event_type: int, event_data: int) -> Verdict:
        nvml = self.nvml
        if event_type & nvml.nvmlEventTypeXidCriticalError:
            return classify_xid(event_data)
        if event_type & nvml.nvmlEventTypeDoubleBitEccError:
            return Verdict(Action.DRAIN, "double-bit ECC error event")
        return Verdict(Action.WATCH, "single-bit ECC error event (corrected)")

    def _poll(self) -> None:
        reading = self.read()
        if reading is None:
            return
        if self._first is None:
            self._first = reading
        if (verdict := judge_reading(reading, self._first)) is not None:
            self.judge(verdict)

    def read(self) -> Reading | None:
        """The GPU's counters now; None when a call failed or hung (already judged)."""
        nvml, handle = self.nvml, self._handle
        values: dict[str, Any] = {}
        for field_name, call, args in (
            ("ecc_uncorrected", "nvmlDeviceGetTotalEccErrors",
             (handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
            ("retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus", (handle,)),
            ("remap", "nvmlDeviceGetRemappedRows", (handle,)),
            ("recovery", "nvmlDeviceGetFieldValues",
             (handle, [getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", RECOVERY_ACTION_FIELD)])),
        ):
            try:
                values[field_name] = self.caller.call(call, getattr(nvml, call), *args)
            except NvmlHung as exc:
                self.judge(Verdict(Action.SUSPECT, f"{exc}: the NVML watchdog gave up on it"))
                return None
            except Exception as exc:  # noqa: BLE001
                if (verdict := classify_nvml_error(call, exc, nvml)) is not None:
                    self.judge(verdict)
                    return None
        remap = values.get("remap")
        recovery = values.get("recovery")
        action = None
        if recovery is not None and len(recovery) and int(getattr(recovery[0], "nvmlReturn", 0)) == 0:
            action = int(recovery[0].value.uiVal)
        return Reading(
            ecc_uncorrected=int(values["ecc_uncorrected"]) if "ecc_uncorrected" in values else None,
            retired_pending=bool(values["retired_pending"]) if "retired_pending" in values else None,
            remap_pending=bool(remap[2]) if remap is not None else None,
            remap_failed=bool(remap[3]) if remap is not None else None,
            recovery_action=action,
        )

    # -- verdicts ----------------------------------------------------------------------------------

    def judge(self, verdict: Verdict) -> None:
        """Act on ``verdict``: count its Xid, log it, and raise the device's state to its action's
        (never lower it); a drain also marks the device :attr:`failed` for its running job."""
        if verdict.xid is None and self.verdicts and self.verdicts[-1] == verdict:
            return  # the same failure again (a call still hung): said and stored once
        self.verdicts.append(verdict)
        if verdict.action is Action.DRAIN and self.failed is None:
            self.failed = verdict
            if self.on_failed is not None:
                self.on_failed(verdict)
        log = logger.warning if verdict.action is Action.WATCH else logger.error
        log("%s: health %s: %s", self.device, verdict.action.value, verdict.reason)
        try:
            if verdict.xid is not None:
                count_xid(self.client, self.device, verdict.xid)
            if verdict.action is not Action.WATCH:
                self._raise_state(verdict)
        except redis.RedisError as exc:  # the next verdict tries again; the job's stop needs no Redis
            logger.warning("%s: could not store the health verdict (%s): %s", self.device, verdict.reason, exc)

    def _raise_state(self, verdict: Verdict) -> None:
        state = _STATE_OF[verdict.action]
        if _RANK[read_state(self.client, self.device).state] >= _RANK[state]:
            return
        write_state(self.client, DeviceState(device=self.device, state=state, reason=verdict.reason,  # type: ignore[arg-type]
                                             by="health", hardware=True, since=redis_now(self.client)))


def open_health(client: redis.Redis, device: str, index: int | None, uuid: str | None = None) -> HealthService | None:
    """The health service of the GPU ``uuid`` (else NVML's GPU ``index``) for ``device``; None
    without an index (a CPU worker) or without ``nvidia-ml-py`` (said in the log)."""
    if index is None:
        return None
    try:
        import pynvml
    except ImportError:
        logger.warning("%s: nvidia-ml-py is not installed: no GPU health service", device)
        return None
    return HealthService(client, device, pynvml, index, uuid=uuid)
