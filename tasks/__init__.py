"""devicefleet: one machine-learning job per device, at once, through Celery and Redis.

The public API::

    import tasks
    results = tasks.fan_out("train", devices="all", kwargs={"epochs": 10}).get(timeout=600)

``celery -A tasks worker -n cpu0@%h`` finds the Celery app here as ``tasks.app``.
Importing this package does not import torch, so a worker can set ``CUDA_VISIBLE_DEVICES``
first.
"""

from . import worker as _worker  # noqa: F401  (connects the worker's Celery signal handlers)
from .celery_app import app, create_app
from .devices import Device, DeviceKind
from .entry import ENTRY_KEYS, EntryStatus
from .errors import (
    ConfigError,
    DeviceFleetError,
    DeviceUnavailable,
    FanOutError,
    FanOutTimeout,
    FleetError,
    InvalidJobArguments,
    JobError,
    NoFleetError,
    UnknownJob,
)
from .fanout import FanOut, JobSpec, fan_out, live_devices
from .fleet import Fleet
from .job import JobContext, job
from .queues import QueueName
from .settings import Settings

__all__ = [
    "ENTRY_KEYS",
    "ConfigError",
    "Device",
    "DeviceFleetError",
    "DeviceKind",
    "DeviceUnavailable",
    "EntryStatus",
    "FanOut",
    "FanOutError",
    "FanOutTimeout",
    "Fleet",
    "FleetError",
    "InvalidJobArguments",
    "JobContext",
    "JobError",
    "JobSpec",
    "NoFleetError",
    "QueueName",
    "Settings",
    "UnknownJob",
    "app",
    "create_app",
    "fan_out",
    "job",
    "live_devices",
]
