"""The device worker: the state of a Celery worker process that owns one device.

Created and driven by its bootstep (:mod:`tasks.worker.bootstep`), in phases:
:meth:`DeviceWorker.prepare` (cores, and the job processes that will run its jobs, started with
the device's visibility: the first one's hello names the allowlist's jobs and what torch sees),
:meth:`DeviceWorker.join` (registry heartbeat, leases, reaper), :meth:`DeviceWorker.drain` (a
stopping worker's running job ends, by itself or by its stop timeout) and
:meth:`DeviceWorker.leave`. The worker process itself never imports torch, never initialises
CUDA and never imports a job module.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import redis
from celery import Celery

from ..core.commands import CommandRules
from ..core.defaults import STOP_SLACK_S
from ..core.devices import (
    Device,
    DeviceKind,
    DeviceNames,
    format_core_list,
    host_name,
    parse_core_list,
    pid_alive,
    plan_cores,
    usable_cores,
)
from ..core.errors import ConfigError, DeviceVisibilityError, FleetError, NoFleetError
from ..core.hiding import environment_secrets, fleet_secrets, hide_from_children
from ..core.queues import worker_queues
from ..core.records import SlotRecord, Visibility, WorkerRecord
from ..core.registry import check_sentinels, connect, read_worker
from ..core.settings import Settings, redact_url
from ..core.wire import DeviceView, ProcessSpec
from ..core.worker_config import WorkerConfig, load_worker_config
from .gang import route_address
from .heartbeat import Heartbeat
from .jobenv import job_environment
from .jobprocess import ProcessGone
from .jobs import JobCatalog
from .lease import LeaseKeeper, Reaper
from .memory import open_meter
from .mps import MpsServer
from .slots import GiB, Slot, Slots, plan_slots
from .supervisor import ProcessPolicy, Supervisor

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
        #: What its first job process saw of the device (:meth:`prepare`).
        self.visibility = DeviceView()
        #: The allowlist's jobs, as the first job process found them (:meth:`prepare`).
        self.jobs = JobCatalog([], settings.job_modules)
        #: The job processes that run this device's jobs (started by :meth:`prepare`).
        self.supervisor: Supervisor | None = None
        #: The CUDA MPS daemon its job processes are clients of (``mps = true``).
        self.mps: MpsServer | None = None
        #: The jobs it runs at once, with their cores and memory budgets (:meth:`prepare`).
        self.slots = Slots([Slot(index=0, cores=[], threads=1, budget_bytes=None)])
        #: When the worker was asked to stop (monotonic), for running jobs' stop timeout.
        self.stopping_since: float | None = None
        self.heartbeat: Heartbeat | None = None
        self.leases: LeaseKeeper | None = None
        self.reaper: Reaper | None = None
        #: The registry's Redis client the background threads share (owned here: closed on leave).
        self._client: redis.Redis | None = None
        self.jobs_done = 0
        #: Guards ``jobs_done``: the slots' threads end jobs at once.
        self.counts_lock = threading.Lock()
        #: Where the other ranks of a distributed job reach this worker (set by :meth:`join`).
        self.address = settings.advertise_address or "127.0.0.1"

    @property
    def queues(self) -> list[str]:
        return worker_queues(self.device, self.config.extra_queues)

    @property
    def seen(self) -> Visibility:
        """What this worker sees of its device, as entries report it."""
        return self.visibility.entry

    @property
    def torch_threads(self) -> int:
        return len(self.cores) if self.config.torch_threads == "auto" else self.config.torch_threads

    @property
    def stop_timeout_s(self) -> float:
        """How long a running job may go on once the worker is asked to stop."""
        return float(self.config.stop_timeout_s or self.config.max_job_seconds)

    def prepare(self) -> None:
        """Cores, then the job processes: the first one's hello names the jobs and what torch sees.

        Raises:
            ConfigError: a job module cannot be imported.
            DeviceVisibilityError: the device is not visible as it should be.
            FleetError: the first job process did not start.
        """
        self.cores = worker_cores(self.settings, self.device, self.config)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)
        try:
            url: str | None = self.settings.resolve_redis_url()
        except NoFleetError:
            url = None  # join() says so; an in-process check of the jobs needs no fleet
        if url is not None:
            self.address = self.settings.advertise_address or route_address(url)
        # Nothing that opens the fleet's Redis reaches a job process: not in its spec, not in
        # its environment, not in this process's /proc/<pid>/environ (tasks.worker.jobenv).
        # Nor Flower's login, where a launcher's environment handed it down.
        secrets = list(dict.fromkeys([*fleet_secrets(url), *environment_secrets()]))
        hide_from_children(secrets)
        spec = ProcessSpec(
            device=self.device.name, torch_device=self.torch_device, cores=self.cores,
            torch_threads=self.torch_threads, job_modules=self.settings.job_modules,
            artifacts_dir=str(self.artifacts_path), tensorboard_dir=str(self.settings.tensorboard_path),
            result_expires_s=self.settings.result_expires_s,
            commands=self.command_rules(), cancel_grace_s=self.config.cancel_grace_s,
        )
        policy = ProcessPolicy(
            jobs_per_process=self.config.jobs_per_process,
            max_memory_growth_bytes=self.config.max_memory_growth_mib * 2**20,
            cancel_grace_s=self.config.cancel_grace_s,
        )
        env = job_environment(self.device, self.torch_threads, secrets)
        if self.config.mps:
            self.mps = MpsServer(self.device, self.settings.state_dir)
            env.update(self.mps.start(int(self.config.memory_gib * GiB) if self.config.memory_gib else None))
        self.supervisor = Supervisor(spec, env, Path.cwd(), policy, label=self.device.name, slots=self.config.slots)
        try:
            hello = self.supervisor.start()
        except ProcessGone as exc:
            self.supervisor.close()
            if self.mps is not None:
                self.mps.stop()
            raise _start_error(self.device, exc) from None
        self.visibility = hello.visibility
        self.jobs = JobCatalog(hello.jobs, self.settings.job_modules)
        self._plan_slots()
        logger.info(
            "%s: CUDA_VISIBLE_DEVICES=%s, cores %s, %d torch threads, device %s; job process %d ready "
            "with jobs %s", self.device, self.visibility.cuda_visible_devices,
            format_core_list(self.cores), self.torch_threads, self.visibility.device_name,
            hello.pid, ", ".join(self.jobs.names),
        )

    def _plan_slots(self) -> None:
        """The device's slots, from its config and what its first job process saw of it, and the
        meter their budgets are enforced with."""
        config = self.config
        gpu = self.device.kind is DeviceKind.GPU
        # One slot without memory_gib: no budget (the device's whole memory is the job's).
        enforced = config.slots > 1 or config.memory_gib is not None
        total = (self.visibility.total_memory if gpu else psutil.virtual_memory().total) if enforced else None
        threads = None if config.torch_threads == "auto" else config.torch_threads
        self.slots = Slots(plan_slots(self.cores, config.slots, threads, config.memory_gib,
                                      total))
        supervisor = self.supervisor
        if supervisor is not None and enforced:
            supervisor.meter = open_meter(self.device.kind.value, self.visibility.uuid,
                                          self.device.index, str(self.device))
        budget = self.slots.all[0].budget_bytes
        logger.info("%s: %d slot%s (cores %s), each with a budget of %s of %s memory", self.device,
                    len(self.slots), "" if len(self.slots) == 1 else "s",
                    " | ".join(format_core_list(slot.cores) for slot in self.slots.all),
                    f"{budget / 2**30:.1f} GiB" if budget else "no limit", "GPU" if gpu else "resident")

    def command_rules(self) -> CommandRules | None:
        """The worker config's ``[commands]``, each program found on this worker's PATH; None
        when it allows none."""
        if not self.config.commands.enabled:
            return None
        rules = self.config.commands.rules()
        if rules.missing:
            logger.warning("%s: commands.programs %s not found on PATH; commands cannot run them",
                           self.device, ", ".join(rules.missing))
        logger.info("%s: commands may run %s in %s", self.device,
                    ", ".join(f"{k} ({v})" for k, v in rules.programs.items()) or "nothing",
                    ", ".join(rules.workdirs))
        return rules

    def record(self) -> WorkerRecord:
        """This worker's registry record."""
        v = self.visibility
        return WorkerRecord(
            device=self.device.name, kind=self.device.kind.value, worker=self.nodename,
            host=host_name(), pid=os.getpid(), queues=self.queues, cores=self.cores,
            pool=self.config.pool.value, jobs=self.jobs.names,
            slots=[SlotRecord(index=slot.index, cores=slot.cores, budget_bytes=slot.budget_bytes)
                   for slot in self.slots.all],
            memory_kind="device" if self.device.kind is DeviceKind.GPU else "resident",
            started_at=time.time(),
            cuda_visible_devices=v.cuda_visible_devices, cuda_available=v.cuda_available,
            device_name=v.device_name, total_memory=v.total_memory, torch_version=v.torch_version,
            torch_threads=v.torch_threads,
            job_pids=self.supervisor.pids if self.supervisor is not None else [],
            commands=self.supervisor.spec.commands if self.supervisor is not None else None,
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
        check_sentinels(url)
        client = self._client = connect(url)
        self.check_unique(client)
        self.heartbeat = Heartbeat(client, self.record(), self.settings.heartbeat_interval_s,
                                   self.settings.heartbeat_ttl_s)
        self.heartbeat.start()
        if self.supervisor is not None:
            heartbeat = self.heartbeat
            supervisor = self.supervisor
            supervisor.on_change = lambda: heartbeat.update(job_pids=supervisor.pids)
            supervisor.on_change()  # a spare that got ready before the hook was there
        self.leases = LeaseKeeper(client, self.device.name, self.nodename, self.settings.lease_ttl_s,
                                  self.settings.replication(url))
        self.leases.start()
        self.reaper = Reaper(client, app, self.settings.reaper_interval_s,
                             orphan_grace_s=2 * self.settings.lease_ttl_s)
        self.reaper.start()
        logger.info("%s joined the fleet at %s", self.device, redact_url(url))

    def begin_stop(self) -> None:
        """The worker was asked to stop: a running job's stop timeout starts now."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()

    def drain(self) -> None:
        """Wait until no job runs (a stopping worker's job ends by itself, or its watch ends it
        after the stop timeout and the grace period; this waits a little longer than both)."""
        supervisor = self.supervisor
        if supervisor is not None:
            supervisor.wait_idle(self.stop_timeout_s + self.config.cancel_grace_s + STOP_SLACK_S)

    def leave(self) -> None:
        """Stop the background threads, remove the registry record, end the job processes."""
        for thread in (self.reaper, self.leases, self.heartbeat):
            if thread is not None:
                thread.stop()
        self.heartbeat = self.leases = self.reaper = None
        if self._client is not None:  # after the threads that used it: its sockets close now
            self._client.close()
            self._client = None
        if self.supervisor is not None:
            self.supervisor.close()
        if self.mps is not None:  # after its clients, the job processes
            self.mps.stop()
            self.mps = None


def _start_error(device: Device, exc: ProcessGone) -> FleetError | ConfigError:
    refused = exc.refused
    if refused is None:
        return FleetError(f"{device}: its first job process did not start: {exc} (python {sys.executable})")
    if refused.config:
        return ConfigError(refused.error.message)
    if refused.error.type == "DeviceVisibilityError":
        return DeviceVisibilityError(refused.error.message)
    return FleetError(f"{device}: its job process refused to start: {refused.error.type}: {refused.error.message}")
