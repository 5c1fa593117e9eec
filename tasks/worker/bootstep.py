"""The owner of a device worker's life: a Celery worker bootstep.

``devicefleet worker cpu0`` and ``celery -A tasks worker -n cpu0@%h`` both start a Celery worker
of a devicefleet app (:class:`tasks.core.app.FleetCelery`), whose blueprint includes
:class:`DeviceWorkerStep`. Following Celery's own components (``celery.worker.components``):

- ``__init__``, while the worker is built: the device from the node name, its config, its
  cores, its job processes (started with the device's visibility; the first one's hello names
  the allowlist's jobs, registered here as ``devicefleet.<job>`` tasks), the device's queues,
  and the pool's concurrency: one job per slot (:mod:`tasks.worker.slots`);
- ``start``, after Celery installed its signal handlers: join the registry (heartbeat, leases,
  reaper) and the stop-at-once handlers (:mod:`tasks.worker.shutdown`);
- ``stop``: a running job gets its stop timeout (Celery stops this step before its pool, so
  the wait is here, while the heartbeat and the lease keeper still run), then leave the
  registry and end the job processes; ``terminate`` (a cold shutdown) ends them at once.

:class:`ConsumerReadyStep` marks the registry record ready once the consumer takes tasks.
A configuration error stops the worker with exit status 2 (systemd does not restart it).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import bootsteps, signals

from ..core.errors import ConfigError, DeviceFleetError
from ..core.job import COLLECT_TASK, task_name
from .device import DeviceWorker
from .runner import JobTask, collect
from .shutdown import install_stop_handlers

logger = logging.getLogger(__name__)

#: Exit status of a configuration error: restarting cannot fix it (``RestartPreventExitStatus=2``).
EXIT_CONFIG = 2
EXIT_FAILURE = 1


def _refuse(nodename: str, exc: DeviceFleetError) -> SystemExit:
    """Say why the worker cannot start, and the exit status to stop with."""
    message = f"devicefleet worker {nodename}: {exc}"
    logger.critical("%s", message)
    print(message, file=sys.stderr, flush=True)
    return SystemExit(EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILURE)


class DeviceWorkerStep(bootsteps.StartStopStep):
    """Creates and runs the :class:`~tasks.worker.device.DeviceWorker` of this Celery worker."""

    label = "DeviceWorker"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        app = parent.app
        try:
            device_worker = DeviceWorker(str(parent.hostname), app.fleet_settings)
            device_worker.prepare()
        except DeviceFleetError as exc:
            raise _refuse(str(parent.hostname), exc) from None
        self.device_worker = device_worker
        # Celery's components hang their state on the worker (w.pool, w.timer): so does this one.
        parent.device_worker = device_worker
        for info in device_worker.jobs.infos():
            task_cls = type(f"JobTask[{info.name}]", (JobTask,), {
                "name": task_name(info.name), "job": info, "device_worker": device_worker,
                "__module__": info.module, "__doc__": info.doc,
            })
            app.register_task(task_cls())
        # The collect step is quick and on every fan-out's path: no STARTED state of its own.
        app.task(name=COLLECT_TASK, shared=False, track_started=False)(collect)
        # Exactly the device's queues, whatever -Q said.
        app.amqp.queues.select(device_worker.queues)
        # One job per slot at once, whatever --concurrency said: the pool and the consumer's
        # prefetch (N messages) are created after every step's __init__ (Blueprint.apply).
        slots = len(device_worker.slots)
        if parent.concurrency != slots:
            logger.info("%s: concurrency %s -> %d, its slots", device_worker.device, parent.concurrency, slots)
        parent.concurrency = parent.min_concurrency = slots
        # A job's lease goes with its stored result (the store script releases it): once Celery
        # stored the outcome, the lease keeper forgets it, or releases one the store did not
        # (it failed, or stored no end) (LeaseKeeper.settle). Connected before the consumer
        # builds its tracers, which read the receivers.
        signals.task_postrun.connect(self._release_lease, weak=False)

    def _release_lease(self, sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
        leases = self.device_worker.leases
        if leases is not None and task_id and isinstance(sender, JobTask):
            leases.settle(task_id, sender.request)

    def start(self, parent: Any) -> None:
        try:
            self.device_worker.join(parent.app)
        except DeviceFleetError as exc:
            raise _refuse(str(parent.hostname), exc) from None
        supervisor = self.device_worker.supervisor
        install_stop_handlers(on_exit=supervisor.kill_all_now if supervisor is not None else None)

    def stop(self, parent: Any) -> None:
        self.device_worker.begin_stop()
        self.device_worker.drain()
        self.device_worker.leave()

    def terminate(self, parent: Any) -> None:
        # A cold shutdown sends the steps 'terminate', not 'stop' (StartStopStep's default
        # does nothing without an obj): leave the registry, and end a running job, at once.
        self.device_worker.leave()

    def shutdown(self, parent: Any) -> None:
        signals.task_postrun.disconnect(self._release_lease)
        self.device_worker.leave()


class ConsumerReadyStep(bootsteps.StartStopStep):
    """Marks the device worker ready in the registry once the consumer takes tasks."""

    label = "DeviceWorkerReady"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, parent: Any) -> None:
        device_worker = getattr(parent.controller, "device_worker", None)
        if device_worker is not None and device_worker.heartbeat is not None:
            device_worker.heartbeat.update(ready=True)
