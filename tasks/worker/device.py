"""The device worker: the state of a Celery worker process that owns one device.

Created and driven by its bootstep (:mod:`tasks.worker.bootstep`), in two phases:
:meth:`DeviceWorker.prepare` (visibility, cores, torch threads, the job allowlist; before anything
imports torch) and :meth:`DeviceWorker.join` (registry heartbeat, leases, reaper), undone by
:meth:`DeviceWorker.leave`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import redis
from celery import Celery

from ..core.devices import (
    Device,
    DeviceKind,
    DeviceNames,
    apply_visibility,
    check_visibility,
    format_core_list,
    host_name,
    parse_core_list,
    pid_alive,
    plan_cores,
    usable_cores,
)
from ..core.errors import ConfigError
from ..core.queues import worker_queues
from ..core.records import Visibility, WorkerRecord
from ..core.registry import connect, read_worker
from ..core.settings import Settings, redact_url
from ..core.worker_config import WorkerConfig, load_worker_config
from .distributed import route_address
from .heartbeat import Heartbeat
from .jobs import JobRegistry
from .lease import LeaseKeeper, Reaper

logger = logging.getLogger(__name__)


def device_from_nodename(nodename: str, settings: Settings) -> Device:
    """``cpu0@host`` -> ``cpu0``; under ``device_names=host`` the whole node name, ``cpu0@host``.

    Raises:
        ConfigError: the part before ``@`` is not a device name.
    """
    name = nodename.split("@", 1)[0]
    try:
        Device.parse(name)
    except ConfigError:
        raise ConfigError(
            f"worker name {nodename!r} does not start with a device name; name the worker after "
            "its device, e.g. `celery -A tasks worker -n cpu0@%h` or `devicefleet worker cpu0`"
        ) from None
    if settings.device_names is DeviceNames.HOST:
        return Device.parse(nodename)
    return Device.parse(name)


def worker_cores(settings: Settings, device: Device, config: WorkerConfig) -> list[int]:
    """The cores ``device``'s worker owns: the setting, the config, else its share of the host."""
    if settings.cores:
        return parse_core_list(settings.cores)
    if config.cores != "auto":
        return parse_core_list(config.cores)
    cores = usable_cores()
    gpus = settings.gpus if settings.gpus is not None else 0
    cpus = settings.cpu_workers or 1
    if device.kind is DeviceKind.CPU:
        cpus = max(cpus, device.index + 1)
    else:
        gpus = max(gpus, device.index + 1)
    return plan_cores(cores, cpus, gpus, config.loader_cores)[device.base]


class DeviceWorker:
    """This process as the worker owning one device."""

    def __init__(self, nodename: str, settings: Settings) -> None:
        self.nodename = nodename
        self.settings = settings
        self.device = device_from_nodename(nodename, settings)
        self.config = load_worker_config(settings.worker_configs_path, self.device)
        self.torch_device = "cuda:0" if self.device.kind is DeviceKind.GPU else "cpu"
        self.artifacts_path = Path(settings.artifacts_path)
        self.cores: list[int] = []
        self.visibility: dict[str, object] = {}
        #: The allowlist's jobs, loaded by :meth:`prepare` (job modules may import torch).
        self.jobs: JobRegistry = JobRegistry([])
        self.heartbeat: Heartbeat | None = None
        self.leases: LeaseKeeper | None = None
        self.reaper: Reaper | None = None
        #: The registry's Redis client the background threads share (owned here: closed on leave).
        self._client: redis.Redis | None = None
        self.jobs_done = 0
        #: Where the other ranks of a distributed job reach this worker (set by :meth:`join`).
        self.address = settings.advertise_address or "127.0.0.1"

    @property
    def queues(self) -> list[str]:
        return worker_queues(self.device, self.config.extra_queues)

    @property
    def seen(self) -> Visibility:
        """What this worker sees of its device, as entries report it."""
        return Visibility(
            cuda_visible_devices=self.visibility.get("cuda_visible_devices"),  # type: ignore[arg-type]
            cuda_available=self.visibility.get("cuda_available"),  # type: ignore[arg-type]
            device_name=self.visibility.get("device_name"),  # type: ignore[arg-type]
        )

    def prepare(self) -> None:
        """Visibility, cores, torch threads, then the allowlist's jobs; before anything imports torch.

        Raises:
            DeviceVisibilityError: the device is not visible as it should be.
            ConfigError: a job module cannot be imported.
        """
        apply_visibility(self.device)
        self.cores = worker_cores(self.settings, self.device, self.config)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)
        # torch is imported here for the first time, with the visibility above.
        self.visibility = check_visibility(self.device)
        import torch

        threads = len(self.cores) if self.config.torch_threads == "auto" else self.config.torch_threads
        torch.set_num_threads(threads)
        self.visibility["torch_threads"] = threads
        self.jobs = JobRegistry(self.settings.job_modules)
        logger.info(
            "%s: CUDA_VISIBLE_DEVICES=%s, cores %s, %d torch threads, device %s",
            self.device, self.visibility["cuda_visible_devices"], format_core_list(self.cores),
            threads, self.visibility["device_name"],
        )

    def record(self) -> WorkerRecord:
        """This worker's registry record."""
        v = self.visibility
        return WorkerRecord(
            device=self.device.name, kind=self.device.kind.value, worker=self.nodename,
            host=host_name(), pid=os.getpid(), queues=self.queues, cores=self.cores,
            pool=self.config.pool.value, concurrency=self.config.concurrency, jobs=self.jobs.names,
            started_at=time.time(),
            cuda_visible_devices=v.get("cuda_visible_devices"),  # type: ignore[arg-type]
            cuda_available=v.get("cuda_available"),  # type: ignore[arg-type]
            device_name=v.get("device_name"),  # type: ignore[arg-type]
            total_memory=v.get("total_memory"),  # type: ignore[arg-type]
            torch_version=v.get("torch_version"),  # type: ignore[arg-type]
            torch_threads=v.get("torch_threads"),  # type: ignore[arg-type]
        )

    def check_unique(self, client: object) -> None:
        """Refuse to join if another live process already owns the device.

        Raises:
            ConfigError: the device is taken.
        """
        other = read_worker(client, self.device.name)  # type: ignore[arg-type]
        if other is None or other.same_process(host_name(), os.getpid()):
            return
        if other.host == host_name() and not pid_alive(other.pid):
            return  # a dead predecessor's entry, about to expire
        raise ConfigError(
            f"device {self.device} is already in the fleet as {other.worker} "
            f"(pid {other.pid} on {other.host}); device names must be unique: "
            "give this worker another name"
        )

    def join(self, app: Celery) -> None:
        """Join the fleet: the registry heartbeat, the lease keeper and the reaper."""
        url = self.settings.resolve_redis_url()
        client = self._client = connect(url)
        self.address = self.settings.advertise_address or route_address(url)
        self.check_unique(client)
        self.heartbeat = Heartbeat(client, self.record(), self.settings.heartbeat_interval_s,
                                   self.settings.heartbeat_ttl_s)
        self.heartbeat.start()
        self.leases = LeaseKeeper(client, self.device.name, self.nodename, self.settings.lease_ttl_s)
        self.leases.start()
        self.reaper = Reaper(client, app, self.settings.reaper_interval_s)
        self.reaper.start()
        logger.info("%s joined the fleet at %s", self.device, redact_url(url))

    def leave(self) -> None:
        """Stop the background threads and remove the registry record."""
        for thread in (self.reaper, self.leases, self.heartbeat):
            if thread is not None:
                thread.stop()
        self.heartbeat = self.leases = self.reaper = None
        if self._client is not None:  # after the threads that used it: its sockets close now
            self._client.close()
            self._client = None
