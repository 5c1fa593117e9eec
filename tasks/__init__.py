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
``tasks.bench`` and ``tasks.cli``. Importing this package loads the core and the producer side
only: not torch (a worker sets ``CUDA_VISIBLE_DEVICES`` first), nor the launcher, rich,
prometheus_client or Flower; :class:`Fleet` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from .core.shadow import warn_if_shadowed
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

if TYPE_CHECKING:
    from .jobs.resident import DeviceData, place_data
    from .ops.fleet import Fleet
    from .producer.optimize import StudyHandle, optimize, optimize_async, start_study

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
    # The launcher is for operators, not producers: loaded when first asked for.
    if name == "Fleet":
        from .ops.fleet import Fleet

        return Fleet
    if name in ("optimize", "optimize_async", "start_study", "StudyHandle"):  # need Optuna, an extra: loaded when first asked for
        from .producer import optimize

        return getattr(optimize, name)
    if name in ("DeviceData", "place_data"):  # for jobs, in the job process: they import torch
        from .jobs import resident

        return getattr(resident, name)
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")
