"""devicefleet: one machine-learning job per device, at once, through Celery and Redis.

The public API::

    import tasks
    results = tasks.fan_out("train", devices="all", kwargs={"epochs": 10}).get(timeout=600)
    results = await tasks.fan_out("train", devices="all")       # from async code, the same handle
    entries = tasks.sweep("train", tasks.grid({"lr": [0.1, 0.01], "seed": [0, 1]})).get()
    study = tasks.optimize("train", {"lr": {"low": 1e-3, "high": 0.3, "log": True}}, 20, "accuracy")

``celery -A tasks worker -n cpu0@%h`` finds the Celery app here as ``tasks.app``.

The package is grouped by who runs the code: ``tasks.core`` (settings, errors, devices, the
Celery app, records and Redis keys: everyone), ``tasks.producer`` (fan-outs), ``tasks.worker``
(the device worker's Celery steps and everything they run), ``tasks.ops`` (the local launcher,
embedded Redis, Flower, the exporter, status views, deploy), ``tasks.jobs`` (built-in jobs),
``tasks.bench`` and ``tasks.cli``. Importing this package loads none of them: each public name
is loaded from its module on first use (PEP 562), so a producer pays for the producer side,
never for torch (a worker sets ``CUDA_VISIBLE_DEVICES`` first), the launcher or Flower, and a job
process (``tasks.jobproc``) never loads Celery, Redis or the settings (about 0.7 s of a core
at each job process's start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.shadow import warn_if_shadowed

if TYPE_CHECKING:
    from .core.app import FleetCelery, app, create_app
    from .core.devices import Device, DeviceKind
    from .core.errors import (
        CommandFailed,
        CommandRefused,
        ConfigError,
        DeviceFailed,
        DeviceFleetError,
        DeviceUnavailable,
        FanOutError,
        FanOutTimeout,
        FleetError,
        FleetLost,
        GroupUnavailable,
        InvalidJobArguments,
        JobCancelled,
        JobCrashed,
        JobError,
        JobTimeout,
        NoFleetError,
        NoJobProcess,
        OutOfMemory,
        PackTooLarge,
        PlacementUnavailable,
        SweepConflict,
        UnknownJob,
        WorkerLost,
        WorkerStopped,
    )
    from .core.job import JobContext, JobMetric, PackData, Packing, job
    from .core.placement import Constraints
    from .core.priority import Level
    from .core.queues import QueueName
    from .core.records import ENTRY_KEYS, DeadLetter, Entry, EntryStatus, JobOptions, WorkerRecord
    from .core.settings import Settings
    from .jobs.resident import DeviceData, place_data
    from .ops.fleet import Fleet
    from .producer import (
        FanOut,
        FleetClient,
        JobHandle,
        JobSpec,
        LogFollower,
        Report,
        Summary,
        Sweep,
        SweepSummary,
        WaitingJob,
        command,
        dead_letters,
        fair_share,
        fan_out,
        follow_logs,
        forget_dead_letter,
        grid,
        live_devices,
        sweep,
        waiting,
    )
    from .producer.optimize import StudyHandle, optimize, optimize_async, start_study

#: Where each public name lives, loaded from there on first use (:func:`__getattr__`): Optuna
#: (``optimize``) is an extra, ``DeviceData`` and ``place_data`` import torch.
_HOMES: dict[str, str] = {name: module for module, names in {
    ".core.app": ("FleetCelery", "app", "create_app"),
    ".core.devices": ("Device", "DeviceKind"),
    ".core.errors": (
        "CommandFailed", "CommandRefused", "ConfigError", "DeviceFailed", "DeviceFleetError",
        "DeviceUnavailable", "FanOutError", "FanOutTimeout", "FleetError", "FleetLost",
        "GroupUnavailable", "InvalidJobArguments", "JobCancelled", "JobCrashed", "JobError",
        "JobTimeout", "NoFleetError", "NoJobProcess", "OutOfMemory", "PackTooLarge",
        "PlacementUnavailable", "SweepConflict", "UnknownJob", "WorkerLost", "WorkerStopped",
    ),
    ".core.job": ("JobContext", "JobMetric", "PackData", "Packing", "job"),
    ".core.placement": ("Constraints",),
    ".core.priority": ("Level",),
    ".core.queues": ("QueueName",),
    ".core.records": (
        "ENTRY_KEYS", "DeadLetter", "Entry", "EntryStatus", "JobOptions", "WorkerRecord",
    ),
    ".core.settings": ("Settings",),
    ".producer": (
        "FanOut", "FleetClient", "JobHandle", "JobSpec", "LogFollower", "Report", "Summary",
        "Sweep", "SweepSummary", "WaitingJob", "command", "dead_letters", "fair_share",
        "fan_out", "follow_logs", "forget_dead_letter", "grid", "live_devices", "sweep",
        "waiting",
    ),
    ".jobs.resident": ("DeviceData", "place_data"),
    ".ops.fleet": ("Fleet",),
    ".producer.optimize": ("StudyHandle", "optimize", "optimize_async", "start_study"),
}.items() for name in names}

__all__ = [
    "ENTRY_KEYS",
    "CommandFailed",
    "CommandRefused",
    "ConfigError",
    "DeadLetter",
    "DeviceData",
    "DeviceFailed",
    "Device",
    "DeviceFleetError",
    "DeviceKind",
    "DeviceUnavailable",
    "Entry",
    "EntryStatus",
    "FanOut",
    "FanOutError",
    "FanOutTimeout",
    "Fleet",
    "FleetCelery",
    "FleetClient",
    "FleetError",
    "FleetLost",
    "GroupUnavailable",
    "PlacementUnavailable",
    "Constraints",
    "InvalidJobArguments",
    "JobCancelled",
    "JobContext",
    "JobCrashed",
    "JobError",
    "JobHandle",
    "JobMetric",
    "PackData",
    "Packing",
    "JobOptions",
    "JobSpec",
    "JobTimeout",
    "Level",
    "LogFollower",
    "NoFleetError",
    "NoJobProcess",
    "OutOfMemory",
    "PackTooLarge",
    "QueueName",
    "Report",
    "Settings",
    "StudyHandle",
    "Summary",
    "Sweep",
    "SweepConflict",
    "SweepSummary",
    "UnknownJob",
    "WaitingJob",
    "WorkerLost",
    "WorkerRecord",
    "WorkerStopped",
    "app",
    "command",
    "create_app",
    "dead_letters",
    "fan_out",
    "follow_logs",
    "forget_dead_letter",
    "grid",
    "job",
    "live_devices",
    "optimize",
    "place_data",
    "optimize_async",
    "start_study",
    "sweep",
    "fair_share",
    "waiting",
]

# A tasks.py or tasks/ of the user's in the working directory: say so once (tasks.core.shadow).
warn_if_shadowed()


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
