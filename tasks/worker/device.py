"""What a device worker is made of, each piece built by one of its bootsteps (:mod:`tasks.worker.steps`):

- :class:`DeviceSetup`: the device it owns (from its node name), its worker config, its cores;
- :class:`JobProcesses`: the job processes that run its jobs (and the CUDA MPS daemon they are
  clients of), started with the device's visibility: the first one's hello names the
  allowlist's jobs and what torch sees;
- :func:`device_slots`: the jobs it runs at once, with their cores and memory budgets;
- :func:`worker_record`: its registry record, which its heartbeat keeps alive;
- :class:`DeviceWorker`: all of it, every service built, as its job tasks are given it when the
  worker registers them (:class:`tasks.worker.runner.JobTask`).

The worker process itself never imports torch, never initialises CUDA and never imports a job
module.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from ..core.accounts import JobAccounts, check_worker_capabilities
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
from ..core.registry import read_worker
from ..core.settings import Settings
from ..core.users import UserKeys
from ..core.wire import DeviceView, ProcessSpec
from ..core.worker_config import WorkerConfig, config_file, load_worker_config
from .gang import route_address
from .group import GroupGate
from .group_host import GroupHostLink, inherited_listener
from .health import HealthService
from .heartbeat import Heartbeat
from .jobenv import job_environment
from .jobprocess import ProcessGone
from .jobs import JobCatalog
from .lease import LeaseKeeper
from .memory import open_meter
from .modes import RunModes
from .mps import MpsServer
from .preemption import Preemption
from .reaper import Reaper
from .service import ServiceWatch
from .siblings import Siblings
from .slots import GiB, Slots, plan_slots
from .supervisor import ProcessPolicy, Supervisor
from .topology import read_links

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


def advertised_address(settings: Settings) -> str:
    """Where the other ranks of a distributed job reach this worker: the setting, else the
    address this host reaches the fleet's Redis from (loopback when there is no fleet: the
    registry step then says so)."""
    if settings.advertise_address:
        return settings.advertise_address
    try:
        return route_address(settings.resolve_redis_url())
    except NoFleetError:
        return "127.0.0.1"


@dataclass(frozen=True)
class DeviceSetup:
    """The device a worker owns, its config, and the cores it runs on."""

    #: Celery's node name, ``cpu0@host``.
    nodename: str
    settings: Settings
    device: Device
    config: WorkerConfig
    cores: list[int]
    #: Where the other ranks of a distributed job reach this worker.
    address: str

    @classmethod
    def plan(cls, nodename: str, settings: Settings) -> DeviceSetup:
        """The setup of the worker named ``nodename``.

        Raises:
            ConfigError: the name is not a device's, or its worker config is invalid.
        """
        device = device_from_nodename(nodename, settings)
        config = load_worker_config(settings.worker_configs_path, device)
        return cls(nodename=nodename, settings=settings, device=device, config=config,
                   cores=worker_cores(settings, device, config), address=advertised_address(settings))

    def pin(self) -> None:
        """Run this process on the worker's cores (its job processes start from them)."""
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)

    @property
    def queues(self) -> list[str]:
        return worker_queues(self.device, self.config.extra_queues)

    @property
    def torch_device(self) -> str:
        return "cuda:0" if self.device.kind is DeviceKind.GPU else "cpu"

    @property
    def torch_threads(self) -> int:
        return len(self.cores) if self.config.torch_threads == "auto" else self.config.torch_threads

    @property
    def stop_timeout_s(self) -> float:
        """How long a running job may go on once the worker is asked to stop."""
        return float(self.config.stop_timeout_s or self.config.max_job_seconds)

    def command_rules(self) -> CommandRules | None:
        """The worker config's ``[commands]``, each program found on this worker's PATH; None
        when it allows none."""
        if not self.config.commands.enabled:
            return None
        rules = self.config.commands.rules(config=str(config_file(self.settings.worker_configs_path, self.device)))
        for problem in rules.problems(str(self.device)):  # the producer refuses what they concern
            logger.warning("%s", problem)
        logger.info("%s: commands may run %s in %s", self.device,
                    ", ".join(f"{k} ({v})" for k, v in rules.programs.items()) or "nothing",
                    ", ".join(rules.workdirs))
        return rules


@dataclass(frozen=True)
class JobProcesses:
    """The job processes that run a device's jobs, the CUDA MPS daemon they are clients of
    (``mps = true`` in the worker config; else None), and what the first process said: the
    allowlist's jobs and what torch sees of the device."""

    supervisor: Supervisor
    mps: MpsServer | None
    visibility: DeviceView
    jobs: JobCatalog

    @classmethod
    def start(cls, setup: DeviceSetup) -> JobProcesses:
        """Start the device's job processes and wait for the first one's hello.

        Raises:
            ConfigError: a job module cannot be imported.
            DeviceVisibilityError: the device is not visible as it should be.
            FleetError: the first job process did not start.
        """
        device, config, settings = setup.device, setup.config, setup.settings
        try:
            url: str | None = settings.resolve_redis_url()
        except NoFleetError:
            url = None  # the registry step says so; an in-process check of the jobs needs no fleet
        # Nothing that opens the fleet's Redis reaches a job process: not in its spec, not in
        # its environment, not in this process's /proc/<pid>/environ (tasks.worker.jobenv).
        # Nor Flower's login, where a launcher's environment handed it down.
        secrets = list(dict.fromkeys([*fleet_secrets(url), *environment_secrets()]))
        hide_from_children(secrets)
        spec = ProcessSpec(
            device=device.name, torch_device=setup.torch_device, cores=setup.cores,
            torch_threads=setup.torch_threads, job_modules=settings.job_modules,
            artifacts_dir=str(Path(settings.artifacts_path)), tensorboard_dir=str(settings.tensorboard_path),
            result_expires_s=settings.result_expires_s,
            commands=setup.command_rules(), cancel_grace_s=config.cancel_grace_s,
        )
        policy = ProcessPolicy(
            jobs_per_process=config.jobs_per_process,
            max_memory_growth_bytes=config.max_memory_growth_mib * 2**20,
            kept_user_processes=config.kept_user_processes,
            cancel_grace_s=config.cancel_grace_s,
        )
        # Under systemd a GPU worker gets a listening socket for the group host, which starts
        # its GPU groups' job processes (tasks.worker.group_host); read before the jobs'
        # environment is made from this one, which must not carry LISTEN_FDS to them.
        listener = inherited_listener()
        env = job_environment(device, setup.torch_threads, secrets)
        mps = None
        if config.mps:
            mps = MpsServer(device, settings.state_dir)
            env.update(mps.start(int(config.memory_gib * GiB) if config.memory_gib else None))
        # Each user's jobs as the user's own system account, where the settings map them.
        accounts = JobAccounts(settings.job_accounts, Path(settings.artifacts_path))
        if accounts:
            check_worker_capabilities()
        supervisor = Supervisor(spec, env, Path.cwd(), policy, label=device.name, slots=config.slots,
                                accounts=accounts)
        if listener is not None:
            supervisor.group_host = GroupHostLink(listener, device.name)
        try:
            hello = supervisor.start()
        except ProcessGone as exc:
            supervisor.close()
            if mps is not None:
                mps.stop()
            raise _start_error(device, exc) from None
        processes = cls(supervisor=supervisor, mps=mps, visibility=hello.visibility,
                        jobs=JobCatalog(hello.jobs, settings.job_modules))
        logger.info(
            "%s: CUDA_VISIBLE_DEVICES=%s, cores %s, %d torch threads, device %s; job process %d ready "
            "with jobs %s", device, processes.visibility.cuda_visible_devices,
            format_core_list(setup.cores), setup.torch_threads, processes.visibility.device_name,
            hello.pid, ", ".join(processes.jobs.names),
        )
        return processes

    @property
    def seen(self) -> Visibility:
        """What this worker sees of its device, as entries report it."""
        return self.visibility.entry

    def close(self) -> None:
        """End every job process (a running job's too), then the MPS daemon, whose clients they were."""
        self.supervisor.close()
        if self.mps is not None:
            self.mps.stop()


def device_slots(setup: DeviceSetup, processes: JobProcesses) -> Slots:
    """The device's slots, from its config and what its first job process saw of it; where
    their budgets are enforced, the supervisor is given the meter it measures them with."""
    config, device = setup.config, setup.device
    gpu = device.kind is DeviceKind.GPU
    # One slot without memory_gib: no budget (the device's whole memory is the job's).
    enforced = config.slots > 1 or config.memory_gib is not None
    total = (processes.visibility.total_memory if gpu else psutil.virtual_memory().total) if enforced else None
    threads = None if config.torch_threads == "auto" else config.torch_threads
    slots = Slots(plan_slots(setup.cores, config.slots, threads, config.memory_gib, total))
    if enforced:
        processes.supervisor.meter = open_meter(device.kind.value, processes.visibility.uuid,
                                                device.index, str(device))
    budget = slots.all[0].budget_bytes
    logger.info("%s: %d slot%s (cores %s), each with a budget of %s of %s memory", device,
                len(slots), "" if len(slots) == 1 else "s",
                " | ".join(format_core_list(slot.cores) for slot in slots.all),
                f"{budget / 2**30:.1f} GiB" if budget else "no limit", "GPU" if gpu else "resident")
    return slots


def worker_record(setup: DeviceSetup, processes: JobProcesses, slots: Slots) -> WorkerRecord:
    """The worker's registry record, as it joins the fleet."""
    v = processes.visibility
    return WorkerRecord(
        device=setup.device.name, kind=setup.device.kind.value, worker=setup.nodename,
        host=host_name(), pid=os.getpid(), queues=setup.queues, cores=setup.cores,
        pool=setup.config.pool.value, jobs=processes.jobs.names, packable=processes.jobs.packable,
        slots=[SlotRecord(index=slot.index, cores=slot.cores, budget_bytes=slot.budget_bytes)
               for slot in slots.all],
        memory_kind="device" if setup.device.kind is DeviceKind.GPU else "resident",
        started_at=time.time(),
        cuda_visible_devices=v.cuda_visible_devices, cuda_available=v.cuda_available,
        device_name=v.device_name, total_memory=v.total_memory, torch_version=v.torch_version,
        torch_threads=v.torch_threads,
        job_pids=processes.supervisor.pids,
        spare_pids=processes.supervisor.spare_pids,
        commands=processes.supervisor.spec.commands,
        gpu_links=read_links(setup.device.index) if setup.device.kind is DeviceKind.GPU else None,
        compute_capability=v.compute_capability, labels=dict(setup.config.labels),
        host_memory=psutil.virtual_memory().total,
    )


def check_unique(client: redis.Redis, setup: DeviceSetup) -> None:
    """Refuse to join if another live process already owns the device.

    Raises:
        ConfigError: the device is taken.
    """
    other = read_worker(client, setup.device.name)
    if other is None or other.same_process(host_name(), os.getpid()):
        return
    if other.host == host_name() and not pid_alive(other.pid):
        return  # a dead predecessor's entry, about to expire
    raise ConfigError(
        f"device {setup.device} is already in the fleet as {other.worker} "
        f"(pid {other.pid} on {other.host}); device names must be unique: "
        "give this worker another name"
    )


@dataclass(eq=False)
class DeviceWorker:
    """This process as the worker owning one device, every service built and none replaced:
    what its job tasks are given when the worker registers them (the job-tasks step, after the
    registry, lease and reaper steps built theirs). Their threads run from the worker's start
    to its stop; a job runs only in between."""

    setup: DeviceSetup
    processes: JobProcesses
    slots: Slots
    #: The registry's Redis client the background threads and progress reports share.
    client: redis.Redis
    heartbeat: Heartbeat
    leases: LeaseKeeper
    reaper: Reaper
    #: Which jobs run here, closed to new single jobs while a device group reserves the device
    #: (:mod:`tasks.worker.group`).
    gate: GroupGate = field(default_factory=GroupGate)
    #: Says when a running job must make way for higher-level work; None: never.
    preemption: Preemption | None = None
    #: The GPU's health service (:mod:`tasks.worker.health`): a job stops once its device
    #: failed; None: the device has none (a CPU device).
    health: HealthService | None = None

    #: The device's service state (drained, quarantined): None, always in service.
    service: ServiceWatch | None = None
    #: When the worker was asked to stop (monotonic), for running jobs' stop timeout; None
    #: while it runs.
    stopping_since: float | None = None
    jobs_done: int = 0
    #: The users' signing keys, to verify the user each job names (:mod:`tasks.core.users`).
    user_keys: UserKeys = field(default_factory=UserKeys)
    #: Guards ``jobs_done``: the slots' threads end jobs at once.
    counts_lock: threading.Lock = field(default_factory=threading.Lock)
    #: How its jobs run (plain, a gang's rank, a device group, a pack), with its services bound.
    modes: RunModes = field(init=False)
    #: Takes a pack's members from its leader's queue (:mod:`tasks.worker.siblings`).
    siblings: Siblings = field(init=False)

    def __post_init__(self) -> None:
        self.modes = RunModes.build(
            self.supervisor, self.client, self.device.name, self.gate, self.address,
            expires_s=self.settings.result_expires_s, lease_ttl_s=self.settings.lease_ttl_s,
            preempt_grace_s=self.config.preempt_grace_s)
        self.siblings = Siblings(self.modes.pack.rooms, self.nodename)

    @property
    def device(self) -> Device:
        return self.setup.device

    @property
    def nodename(self) -> str:
        return self.setup.nodename

    @property
    def settings(self) -> Settings:
        return self.setup.settings

    @property
    def config(self) -> WorkerConfig:
        return self.setup.config

    @property
    def supervisor(self) -> Supervisor:
        return self.processes.supervisor

    @property
    def jobs(self) -> JobCatalog:
        return self.processes.jobs

    @property
    def seen(self) -> Visibility:
        return self.processes.seen

    @property
    def address(self) -> str:
        """Where the other ranks of a distributed job reach this worker."""
        return self.setup.address

    @property
    def stop_timeout_s(self) -> float:
        return self.setup.stop_timeout_s

    def begin_stop(self) -> None:
        """The worker was asked to stop: a running job's stop timeout starts now."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()

    def drain(self) -> None:
        """Wait until no job runs (a stopping worker's job ends by itself, or its watch ends it
        after the stop timeout and the grace period; this waits a little longer than both)."""
        self.supervisor.wait_idle(self.stop_timeout_s + self.config.cancel_grace_s + STOP_SLACK_S)


def _start_error(device: Device, exc: ProcessGone) -> FleetError | ConfigError:
    refused = exc.refused
    if refused is None:
        return FleetError(f"{device}: its first job process did not start: {exc} (python {sys.executable})")
    if refused.config:
        return ConfigError(refused.error.message)
    if refused.error.type == "DeviceVisibilityError":
        return DeviceVisibilityError(refused.error.message)
    return FleetError(f"{device}: its job process refused to start: {refused.error.type}: {refused.error.message}")
