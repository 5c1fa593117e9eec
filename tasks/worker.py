"""A device worker: a Celery worker that owns one device and sees only that device.

``devicefleet worker cpu0`` and ``celery -A tasks worker -n cpu0@%h`` both end up here, through
Celery's signals:

- ``celeryd_init`` (before the pool exists): set ``CUDA_VISIBLE_DEVICES``, pin the worker to its
  cores, then import torch and refuse to start if the device is not visible as it should be;
- ``celeryd_after_setup`` (after ``-Q``): consume exactly the device's queues;
- ``worker_ready``: join the fleet registry; ``worker_shutdown``: leave it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import celeryd_after_setup, celeryd_init, worker_ready, worker_shutdown

from . import faults, lease, metrics, progress, registry
from . import shutdown as _shutdown  # noqa: F401  (second SIGTERM / SIGQUIT: stop at once)
from .devices import (
    Device,
    DeviceKind,
    DeviceNames,
    apply_visibility,
    check_visibility,
    format_core_list,
    host_name,
    parse_core_list,
    plan_cores,
    usable_cores,
)
from .entry import error_info, make_entry
from .errors import ConfigError, DeviceFleetError, FleetError, JobError, OutOfMemory
from .job import JobContext, JobRegistry
from .queues import worker_queues
from .settings import Settings, redact_url
from .worker_config import WorkerConfig, load_worker_config

logger = logging.getLogger(__name__)

_current: DeviceWorker | None = None


def current_worker() -> DeviceWorker:
    """The device worker of this process.

    Raises:
        FleetError: this process is not a device worker.
    """
    if _current is None:
        raise FleetError(
            "this Celery worker owns no device: start it as `devicefleet worker cpu0` or "
            "`celery -A tasks worker -n cpu0@%h`"
        )
    return _current


def device_from_nodename(nodename: str, settings: Settings | None = None) -> Device:
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
    if settings is not None and settings.device_names is DeviceNames.HOST:
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
    """The state of this process as the worker owning one device."""

    def __init__(self, nodename: str, settings: Settings) -> None:
        self.nodename = nodename
        self.settings = settings
        self.device = device_from_nodename(nodename, settings)
        self.config = load_worker_config(settings.worker_configs_path, self.device)
        self.cores: list[int] = []
        self.visibility: dict[str, Any] = {}
        self.jobs: JobRegistry | None = None
        self.heartbeat: registry.Heartbeat | None = None
        self.leases: lease.LeaseKeeper | None = None
        self.reaper: lease.Reaper | None = None
        self.jobs_done = 0

    # -- start-up ------------------------------------------------------------------------------

    def prepare_process(self) -> None:
        """Visibility, cores and torch threads; must run before anything imports torch."""
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

    @property
    def queues(self) -> list[str]:
        return worker_queues(self.device, self.config.extra_queues)

    def record(self) -> dict[str, Any]:
        """This worker's registry record."""
        return {
            "device": self.device.name,
            "kind": self.device.kind.value,
            "worker": self.nodename,
            "host": host_name(),
            "pid": os.getpid(),
            "queues": self.queues,
            "cores": self.cores,
            "pool": self.config.pool.value,
            "concurrency": self.config.concurrency,
            "jobs": self.jobs.names if self.jobs else [],
            "started_at": time.time(),
            "busy": None,
            "jobs_done": 0,
            **{key: self.visibility.get(key) for key in (
                "cuda_visible_devices", "cuda_available", "device_name", "total_memory",
                "torch_version", "torch_threads",
            )},
        }

    def check_unique(self, client: Any) -> None:
        """Refuse to join if another live process on another host already owns the device."""
        raw = client.get(registry.worker_key(self.device.name))
        if raw is None:
            return
        other = json.loads(raw)
        if other.get("host") == host_name() and other.get("pid") == os.getpid():
            return
        if other.get("host") == host_name():
            try:
                os.kill(int(other["pid"]), 0)
            except (ProcessLookupError, ValueError, KeyError):
                return  # a dead predecessor's entry, about to expire
        raise ConfigError(
            f"device {self.device} is already in the fleet as {other.get('worker')} "
            f"(pid {other.get('pid')} on {other.get('host')}); device names must be unique: "
            "give this worker another name"
        )

    def join(self, app: Celery | None = None) -> None:
        url = self.settings.resolve_redis_url()
        client = registry.connect(url)
        self.check_unique(client)
        self.heartbeat = registry.Heartbeat(
            client, self.record(), self.settings.heartbeat_interval_s, self.settings.heartbeat_ttl_s
        )
        self.heartbeat.start()
        self.leases = lease.LeaseKeeper(client, self.device.name, self.nodename,
                                        self.settings.lease_ttl_s)
        self.leases.start()
        if app is not None:
            self.reaper = lease.Reaper(client, app, self.settings.reaper_interval_s)
            self.reaper.start()
        logger.info("%s joined the fleet at %s", self.device, redact_url(url))

    def leave(self) -> None:
        for thread in (self.reaper, self.leases):
            if thread is not None:
                thread.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    # -- running jobs --------------------------------------------------------------------------

    def torch_device(self) -> str:
        return "cuda:0" if self.device.kind is DeviceKind.GPU else "cpu"

    def execute(self, task: Any, device: str, job: str, kwargs: Any) -> dict[str, Any]:
        """Run one job and return its entry; a failure becomes an error entry, never a raise.

        Raises:
            celery.exceptions.Ignore: this job already runs on another live worker (see
                :mod:`tasks.lease`); this copy is dropped.
        """
        if self.leases is None or task.request.id is None:
            return self._execute(task, device, job, kwargs)
        with self.leases.hold(task):
            return self._execute(task, device, job, kwargs)

    def _execute(self, task: Any, device: str, job: str, kwargs: Any) -> dict[str, Any]:
        started = time.time()
        job_id = str(task.request.id or f"local-{started}")
        output: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        recycle = False
        if self.heartbeat is not None:
            self.heartbeat.update(busy={"job": str(job), "job_id": job_id, "since": started})
        try:
            if device != self.device.name:
                raise JobError(f"a job for {device!r} reached the worker of {self.device}")
            assert self.jobs is not None
            kwargs, fallback = faults.pop_fallback(kwargs)
            definition, params = self.jobs.parse(job, kwargs)
            ctx = JobContext(
                device=self.device.name,
                torch_device=self.torch_device(),
                job_id=job_id,
                artifacts_dir=Path(self.settings.artifacts_path) / job_id,
                cores=self.cores,
                reporter=lambda fields: progress.publish(task, self.device.name, fields, self.heartbeat),
            )
            result, recycle = faults.run_guarded(definition.func, ctx, params, fallback)
            if not isinstance(result, dict):
                raise JobError(f"job {job!r} returned {type(result).__name__}, not a dict")
            json.dumps(result)  # results travel as JSON: fail here, in the entry, not in Celery
            output = result
        except DeviceFleetError as exc:
            logger.warning("%s: job %s failed: %s", self.device, job, exc)
            error = dict(error_info(exc))
            if isinstance(exc, OutOfMemory):
                error["memory"] = exc.memory
                recycle = exc.recycle
        except Exception as exc:  # a job's own failure: reported, never fatal to the worker
            logger.exception("%s: job %s raised", self.device, job)
            error = error_info(exc)
        finally:
            self.jobs_done += 1
            if self.heartbeat is not None:
                self.heartbeat.update(busy=None, progress=None, jobs_done=self.jobs_done)
        finished = time.time()
        self._record_metrics(job_id, "ok" if error is None else "error", started, finished, output)
        faults.recycle_if_needed(recycle, self.device.name)
        return make_entry(
            device=self.device.name,
            worker=self.nodename,
            output=output,
            error=error,
            started=started,
            finished=finished,
            visibility=self.visibility,
        )

    def _record_metrics(self, job_id: str, status: str, started: float, finished: float,
                        output: dict[str, Any] | None) -> None:
        """Count the finished job in Redis for the fleet's metrics (best effort)."""
        if self.heartbeat is None:
            return
        try:
            metrics.record_job(
                self.heartbeat.client, self.device.name, self.nodename, job_id=job_id,
                status=status, started=started, finished=finished, output=output,
                gpu_memory_bytes=metrics.gpu_memory_in_use(),
            )
        except Exception as exc:
            logger.warning("%s: could not record job metrics: %s", self.device, exc)


# -- Celery signal handlers ----------------------------------------------------------------------


def _is_devicefleet(instance: Any) -> bool:
    """Whether the starting worker runs a devicefleet app (see :func:`tasks.celery_app.create_app`)."""
    return bool(getattr(getattr(instance, "app", None), "devicefleet", False))


@celeryd_init.connect
def _on_init(sender: str, instance: Any, conf: Any, options: dict[str, Any], **_: Any) -> None:
    global _current
    if not _is_devicefleet(instance):
        logger.debug("worker %s runs another Celery app: not a devicefleet device worker", sender)
        return
    try:
        worker = DeviceWorker(str(sender), Settings.load())
        worker.prepare_process()
    except DeviceFleetError as exc:
        # Celery logs and swallows exceptions from signal handlers; SystemExit stops the worker.
        logger.critical("%s", exc)
        raise SystemExit(f"devicefleet worker {sender}: {exc}") from None
    _current = worker


@celeryd_after_setup.connect
def _on_after_setup(sender: str, instance: Any, conf: Any, **_: Any) -> None:
    if _current is None:
        return
    app: Celery = instance.app
    app.amqp.queues.select(_current.queues)
    try:
        _current.join(app)
    except DeviceFleetError as exc:
        logger.critical("%s", exc)
        raise SystemExit(f"devicefleet worker {sender}: {exc}") from None


@worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    if _current is not None and _current.heartbeat is not None:
        _current.heartbeat.update(ready=True)


@worker_shutdown.connect
def _on_shutdown(sender: Any = None, **_: Any) -> None:
    if _current is not None:
        _current.leave()
