"""A fake of the few ``pynvml`` calls the fleet makes, driven by a scenario (issue 50's health tests).

Put this folder first on a worker's PYTHONPATH and name a scenario file (JSON) in
``DEVICEFLEET_FAKE_NVML``; it is read at ``nvmlInit``. Keys, all optional::

    {"events":   [{"at": 1.0, "xid": 79}, {"at": 2.0, "type": "dbe"}, {"at": 3.0, "type": "sbe"}],
     "trigger":  "/path/file",          # event times count from when this file exists (else nvmlInit)
     "fail":     {"nvmlDeviceGetTotalEccErrors": "Unknown"},    # every call raises NVMLError_<name>
     "hang":     {"nvmlDeviceGetRemappedRows": 30},             # every call sleeps this long first
     "counters": {"ecc_uncorrected": 0, "retired_pending": 0, "remap": [0, 0, 0, 0],
                  "recovery_action": 0}}

Every call is appended to ``calls`` (in process) for the in-process tests; :func:`release` ends
every hang at once.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCENARIO_ENV = "DEVICEFLEET_FAKE_NVML"
FAKE = True

nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeAll = 0xFFF
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 271


class NVMLError(Exception):
    pass


def _error(name: str) -> type[NVMLError]:
    cls = type(f"NVMLError_{name}", (NVMLError,), {})
    globals()[cls.__name__] = cls
    return cls


for _name in ("NotSupported", "Timeout", "Unknown", "GpuIsLost", "Uninitialized", "NotFound", "InvalidArgument",
              "DriverNotLoaded"):
    _error(_name)

calls: list[str] = []
_scenario: dict[str, Any] = {}
_started = 0.0
_delivered: set[int] = set()
_released = threading.Event()
_lock = threading.Lock()


def release() -> None:
    """End every hang now (a test's cleanup)."""
    _released.set()


def _enter(name: str) -> None:
    calls.append(name)
    hang = _scenario.get("hang", {}).get(name)
    if hang:
        _released.wait(float(hang))
    failure = _scenario.get("fail", {}).get(name)
    if failure:
        raise globals()[f"NVMLError_{failure}"](f"fake NVML: {name} fails ({failure})")


def nvmlInit() -> None:
    global _scenario, _started
    path = os.environ.get(SCENARIO_ENV)
    with _lock:
        _scenario = json.loads(Path(path).read_text()) if path else {}
        _started = time.monotonic()
        _delivered.clear()
    _enter("nvmlInit")


def nvmlShutdown() -> None:
    _enter("nvmlShutdown")


def nvmlDeviceGetCount() -> int:
    _enter("nvmlDeviceGetCount")
    return int(_scenario.get("devices", 1))


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    _enter("nvmlDeviceGetHandleByIndex")
    return SimpleNamespace(index=index)


def nvmlDeviceGetHandleByUUID(uuid: str) -> Any:
    _enter("nvmlDeviceGetHandleByUUID")
    raise NVMLError_NotFound(f"fake NVML: no GPU {uuid}")  # type: ignore[name-defined]  # noqa: F821


def nvmlDeviceGetSupportedEventTypes(handle: Any) -> int:
    _enter("nvmlDeviceGetSupportedEventTypes")
    return nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError


def nvmlEventSetCreate() -> Any:
    _enter("nvmlEventSetCreate")
    return SimpleNamespace(mask=0)


def nvmlDeviceRegisterEvents(handle: Any, mask: int, events: Any) -> None:
    _enter("nvmlDeviceRegisterEvents")
    events.mask = mask


def nvmlEventSetFree(events: Any) -> None:
    _enter("nvmlEventSetFree")


_TYPES = {"xid": nvmlEventTypeXidCriticalError, "dbe": nvmlEventTypeDoubleBitEccError,
          "sbe": nvmlEventTypeSingleBitEccError}


def _origin() -> float | None:
    """When event times count from: the trigger file's appearance (None: not yet), else nvmlInit."""
    trigger = _scenario.get("trigger")
    if not trigger:
        return _started
    path = Path(trigger)
    if not path.exists():
        return None
    return time.monotonic() - max(0.0, time.time() - path.stat().st_mtime)


def nvmlEventSetWait(events: Any, timeout_ms: int) -> Any:
    _enter("nvmlEventSetWait")
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        origin = _origin()
        if origin is not None:
            for number, event in enumerate(_scenario.get("events", [])):
                if number in _delivered or time.monotonic() < origin + float(event.get("at", 0)):
                    continue
                _delivered.add(number)
                kind = _TYPES["xid"] if "xid" in event else _TYPES[event["type"]]
                return SimpleNamespace(device=None, eventType=kind, eventData=int(event.get("xid", 0)),
                                       gpuInstanceId=0, computeInstanceId=0)
        if time.monotonic() >= deadline:
            raise NVMLError_Timeout("fake NVML: no event")  # type: ignore[name-defined]  # noqa: F821
        time.sleep(0.02)


def _counter(name: str, default: Any) -> Any:
    return _scenario.get("counters", {}).get(name, default)


def nvmlDeviceGetTotalEccErrors(handle: Any, error_type: int, counter_type: int) -> int:
    _enter("nvmlDeviceGetTotalEccErrors")
    return int(_counter("ecc_uncorrected", 0))


def nvmlDeviceGetRetiredPagesPendingStatus(handle: Any) -> int:
    _enter("nvmlDeviceGetRetiredPagesPendingStatus")
    return int(_counter("retired_pending", 0))


def nvmlDeviceGetRemappedRows(handle: Any) -> tuple[int, int, int, int]:
    _enter("nvmlDeviceGetRemappedRows")
    corrected, uncorrected, pending, failed = _counter("remap", [0, 0, 0, 0])
    return int(corrected), int(uncorrected), int(pending), int(failed)


def nvmlDeviceGetFieldValues(handle: Any, field_ids: list[Any]) -> list[Any]:
    _enter("nvmlDeviceGetFieldValues")
    action = int(_counter("recovery_action", 0))
    return [SimpleNamespace(fieldId=field, nvmlReturn=0, value=SimpleNamespace(uiVal=action)) for field in field_ids]


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
    _enter("nvmlDeviceGetComputeRunningProcesses")
    return []
