"""A device worker's life as Celery bootsteps: one service per step, each declaring what it requires.

``devicefleet worker cpu0`` and ``celery -A tasks worker -n cpu0@%h`` both start a Celery worker
of a devicefleet app (:class:`tasks.core.app.FleetCelery`), which adds these steps to Celery's
own by import path (:data:`tasks.core.app.WORKER_STEPS`), as Celery names its own components
(``celery.worker.components``; ``celery.worker.consumer.heart`` is the model of a small step).
Celery builds the steps in the order their ``requires`` give (each after the steps whose
services it uses), starts them in that order and stops them in reverse::

    step                built with the worker                 start                    stop
    DeviceStep          the device (from the node name), its  -                        -
                        config, its cores (pinned)
    JobProcessesStep    the job processes and the CUDA MPS    -                        end them (terminate: same)
                        daemon, started: the first one's
                        hello names the jobs, what torch sees
    SlotsStep           the slots, the meter of their budgets -                        -
    RegistryStep        the Redis client, the heartbeat       no other live process    remove the record, close
                                                              owns the device? then    the client
                                                              the first write
    HealthStep          the GPU's health service (NVML;       watch the GPU            stop watching
                        none on a CPU device)
    LeaseStep           the lease keeper                      renew leases             stop renewing
    PreemptionStep      the preemption watch                  look for higher-level    stop looking
                                                              work while jobs run
    ReaperStep          the reaper                            reap                     stop reaping
    CancelRelayStep     the relay of the users' cancels       relay them               stop relaying
    AclUsersStep        the keeper of the users' ACL users    make lost ones again     stop keeping
    ServiceStep         the watch of the device's state       read it: out of service, stop reading it
                                                              the consumer takes none
    JobsStep            the DeviceWorker of all the above;    -                        a running job gets its
                        the job tasks, given it; the                                   stop timeout (terminate:
                        device's queues; one job per slot                              no wait)
    GroupsStep          the keeper of the groups that         look at the device's     stop looking (the gate
                        reserve the device                    reservations             stays as it was)
    StopHandlersStep    -                                     a 2nd SIGTERM or a       -
                                                              SIGQUIT stops at once

A step with one service hands it to Celery as the step's ``obj`` (what its ``create`` returns),
which ``StartStopStep`` starts, stops and terminates, as Celery's own ``Beat`` step does.
Everything is built in ``__init__``, before Celery creates its pool (``Blueprint.apply`` runs
every step's ``__init__``, then each one's ``create``): the pool's size is the device's slot
count, and the slots and the jobs are known only once the first job process said what it sees.
The worker starts after Celery installed its own signal handlers, and stops its steps before its
pool: the jobs step stops first, so a job that ends within its stop timeout is stored with its
lease and counted while the heartbeat, the lease keeper and the reaper still run; the job
processes end last, the MPS daemon after its clients.

:class:`ConsumerReadyStep`, a step of the consumer's blueprint (started after every worker
step), marks the registry record ready once the consumer takes tasks. A configuration error
stops the worker with exit status 2 (systemd does not restart it), any other refusal with 1.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from celery import bootsteps, signals

from ..core.defaults import ACL_USERS_CHECK_S, CANCEL_RELAY_INTERVAL_S
from ..core.devices import DeviceKind
from ..core.errors import DeviceFleetError, start_exit_status
from ..core.job import COLLECT_TASK, task_name
from ..core.queue_lists import leveled
from ..core.registry import check_sentinels, connect
from ..core.settings import redact_url
from ..core.users import restore_acl_users
from .acl_keeper import AclUsersKeeper
from .cancels import CancelRelay
from .device import DeviceSetup, DeviceWorker, JobProcesses, check_unique, device_slots, worker_record
from .group import GroupKeeper
from .health import open_health
from .heartbeat import Heartbeat
from .lease import LeaseKeeper
from .preemption import Preemption, consumed_lists
from .reaper import Reaper
from .runner import JobTask, collect
from .service import ServiceWatch
from .shutdown import install_stop_handlers

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=bootsteps.Step)


def built(parent: Any, step: type[S]) -> S:
    """The instance of ``step`` in ``parent``'s blueprint (a step reads the services of the
    steps it requires: they were built before it)."""
    found = parent.blueprint.steps[step.name]
    assert isinstance(found, step), f"{step.name} is not built yet: require it"
    return found


@contextmanager
def refusing(parent: Any) -> Iterator[None]:
    """Turn devicefleet's error into the worker's refusal: say why it cannot start, and exit
    with :func:`~tasks.core.errors.start_exit_status` (2 for a configuration error, which
    ``RestartPreventExitStatus=2`` keeps systemd from restarting; else 1)."""
    try:
        yield
    except DeviceFleetError as exc:
        message = f"devicefleet worker {parent.hostname}: {exc}"
        logger.critical("%s", message)
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(start_exit_status(exc)) from None


class DeviceStep(bootsteps.Step):
    """The device this worker owns (its node name says which), its worker config, and its cores,
    which this process is pinned to now (its job processes start from them)."""

    label = "Device"
    # After the pool step's __init__, which reads the concurrency the jobs step sets.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        with refusing(parent):
            self.setup = DeviceSetup.plan(str(parent.hostname), parent.app.fleet_settings)
        self.setup.pin()


class JobProcessesStep(bootsteps.StartStopStep):
    """The job processes that run the device's jobs (and its CUDA MPS daemon): started as the
    worker is built, since the first one's hello names the jobs; ended when it stops or
    terminates (a running job's process too: the jobs step has waited for it, or it is a cold
    shutdown)."""

    label = "JobProcesses"
    requires = (DeviceStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        with refusing(parent):
            self.processes = JobProcesses.start(built(parent, DeviceStep).setup)

    def start(self, parent: Any) -> None:
        pass  # running since the worker was built

    def stop(self, parent: Any) -> None:
        self.processes.close()

    terminate = stop


class SlotsStep(bootsteps.Step):
    """The jobs the device runs at once, each on its share of the cores and within its memory
    budget (:mod:`tasks.worker.slots`), from its config and what the first job process saw."""

    label = "Slots"
    requires = (JobProcessesStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.slots = device_slots(built(parent, DeviceStep).setup, built(parent, JobProcessesStep).processes)


class RegistryStep(bootsteps.StartStopStep):
    """The worker's record in the fleet's registry, kept alive by its heartbeat, and the Redis
    client the worker's own background work shares: the client is made as the worker is built
    (no round trip yet), the record written at start once no other live process owns the device,
    removed at stop, and the client closed after it."""

    label = "Registry"
    requires = (SlotsStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        setup, processes = built(parent, DeviceStep).setup, built(parent, JobProcessesStep).processes
        with refusing(parent):
            self.url = setup.settings.resolve_redis_url()
        self.client = connect(self.url)
        self.heartbeat = Heartbeat(self.client, worker_record(setup, processes, built(parent, SlotsStep).slots),
                                   setup.settings.heartbeat_interval_s, setup.settings.heartbeat_ttl_s,
                                   schemas=processes.jobs.schemas())

    def start(self, parent: Any) -> None:
        setup, supervisor = built(parent, DeviceStep).setup, built(parent, JobProcessesStep).processes.supervisor
        with refusing(parent):
            check_sentinels(self.url)
            check_unique(self.client, setup)
        # A restarted Redis lost the users' ACL users (on Sentinel: a replica or sentinel too).
        restored = restore_acl_users(self.client, self.url)
        if restored:
            logger.warning("made again the Redis ACL users of %s (Redis restarted)", ", ".join(restored))
        heartbeat = self.heartbeat
        heartbeat.start()
        supervisor.on_change = lambda: heartbeat.update(job_pids=supervisor.pids, spare_pids=supervisor.spare_pids)
        supervisor.on_change()  # a spare that got ready before the hook was there
        logger.info("%s joined the fleet at %s", setup.device, redact_url(self.url))

    def stop(self, parent: Any) -> None:
        self.heartbeat.stop()
        self.client.close()  # after the threads that used it: its sockets close now

    terminate = stop


class HealthStep(bootsteps.StartStopStep):
    """The GPU's health service (:mod:`tasks.worker.health`): NVML's events and counters, on
    threads of its own beside the heartbeat; a fatal event drains the device and ends its
    running job as a device failure. None on a CPU worker (unless its config names an NVML index)."""

    label = "Health"
    requires = (RegistryStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        setup = built(parent, DeviceStep).setup
        index, uuid = setup.config.health_nvml_index, None
        if index is None and setup.device.kind is DeviceKind.GPU:
            index, uuid = setup.device.index, built(parent, JobProcessesStep).processes.visibility.uuid
        self.health = open_health(built(parent, RegistryStep).client, setup.device.name, index, uuid)

    def start(self, parent: Any) -> None:
        if self.health is not None:
            # The drain it wrote is obeyed as any drain is, by the service watch (one owner of
            # whether the device consumes): woken now rather than at its next read.
            watch = built(parent, ServiceStep).watch
            self.health.on_failed = lambda verdict: watch.wake()
            self.health.start()

    def stop(self, parent: Any) -> None:
        if self.health is not None:
            self.health.stop()

    terminate = stop


class LeaseStep(bootsteps.StartStopStep):
    """The lease keeper: takes, renews and releases the leases of the jobs this worker runs
    (:mod:`tasks.worker.lease`)."""

    label = "Leases"
    requires = (RegistryStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        setup, registry = built(parent, DeviceStep).setup, built(parent, RegistryStep)
        self.leases = LeaseKeeper(registry.client, setup.device.name, setup.nodename, setup.settings.lease_ttl_s,
                                  setup.settings.replication(registry.url))
        # A job's lease goes with its stored result (the store script releases it): once Celery
        # stored the outcome, the lease keeper forgets it, or releases one the store did not
        # (it failed, or stored no end) (LeaseKeeper.settle). Connected before the consumer
        # builds its tracers, which read the receivers.
        signals.task_postrun.connect(self._settle_lease, weak=False)

    def _settle_lease(self, sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
        if task_id and isinstance(sender, JobTask):
            self.leases.settle(task_id, sender.request)

    def start(self, parent: Any) -> None:
        self.leases.start()

    def stop(self, parent: Any) -> None:
        signals.task_postrun.disconnect(self._settle_lease)
        self.leases.stop()

    terminate = stop


class PreemptionStep(bootsteps.StartStopStep):
    """The preemption watch: while the worker runs lower-level jobs, looks for higher-level work
    waiting in its queues (:mod:`tasks.worker.preemption`)."""

    label = "Preemption"
    requires = (SlotsStep, RegistryStep)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        setup = built(parent, DeviceStep).setup
        self.preemption = Preemption(built(parent, RegistryStep).client, consumed_lists(parent.app, setup.queues),
                                     slots=len(built(parent, SlotsStep).slots),
                                     min_run_s=setup.config.preempt_min_run_s,
                                     grace_s=setup.config.preempt_grace_s)

    def create(self, parent: Any) -> Preemption:
        return self.preemption  # the step's obj: StartStopStep starts and stops it


class ReaperStep(bootsteps.StartStopStep):
    """The reaper, which gives back the jobs of workers that died holding them
    (:mod:`tasks.worker.reaper`)."""

    label = "Reaper"
    requires = (RegistryStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        settings = built(parent, DeviceStep).setup.settings
        self.reaper = Reaper(built(parent, RegistryStep).client, parent.app, settings.reaper_interval_s,
                             orphan_grace_s=2 * settings.lease_ttl_s)

    def create(self, parent: Any) -> Reaper:
        return self.reaper  # the step's obj: StartStopStep starts and stops it


class CancelRelayStep(bootsteps.StartStopStep):
    """The users' own cancels (issue 49), sent on with the fleet's credentials
    (:mod:`tasks.worker.cancels`)."""

    label = "CancelRelay"
    requires = (RegistryStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.cancels = CancelRelay(built(parent, RegistryStep).client, parent.app, CANCEL_RELAY_INTERVAL_S)

    def create(self, parent: Any) -> CancelRelay:
        return self.cancels  # the step's obj: StartStopStep starts and stops it


class AclUsersStep(bootsteps.StartStopStep):
    """The users' Redis ACL users, made again where a restarted Redis (or replica, or sentinel)
    lost them (:mod:`tasks.worker.acl_keeper`)."""

    label = "AclUsers"
    requires = (RegistryStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        registry = built(parent, RegistryStep)
        self.acl_users = AclUsersKeeper(registry.client, registry.url, ACL_USERS_CHECK_S)

    def create(self, parent: Any) -> AclUsersKeeper:
        return self.acl_users  # the step's obj: StartStopStep starts and stops it


class ServiceStep(bootsteps.StartStopStep):
    """The device's service state, obeyed: out of service (drained, quarantined, suspect), the
    consumer takes nothing (:mod:`tasks.worker.service`)."""

    label = "Service"
    requires = (RegistryStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.watch = ServiceWatch(built(parent, RegistryStep).client, built(parent, DeviceStep).setup.device.name)

    def create(self, parent: Any) -> ServiceWatch:
        return self.watch  # the step's obj: StartStopStep starts and stops it


class JobsStep(bootsteps.StartStopStep):
    """The device's jobs as the Celery tasks ``devicefleet.<job>``, each given the worker's
    services (:class:`~tasks.worker.device.DeviceWorker`), with the collect step; exactly the
    device's queues; one job per slot at once. At stop, first of these steps, a running job
    gets its stop timeout (:meth:`~tasks.worker.device.DeviceWorker.drain`)."""

    label = "Jobs"
    requires = (LeaseStep, ReaperStep, CancelRelayStep, AclUsersStep, PreemptionStep, HealthStep, ServiceStep)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        app, registry = parent.app, built(parent, RegistryStep)
        worker = self.worker = DeviceWorker(
            setup=built(parent, DeviceStep).setup, processes=built(parent, JobProcessesStep).processes,
            slots=built(parent, SlotsStep).slots, client=registry.client, heartbeat=registry.heartbeat,
            leases=built(parent, LeaseStep).leases, reaper=built(parent, ReaperStep).reaper,
            preemption=built(parent, PreemptionStep).preemption, health=built(parent, HealthStep).health,
            service=built(parent, ServiceStep).watch,
        )
        # Celery's components hang their state on the worker (w.pool, w.timer): so does this one
        # (the consumer answers a job outside the allowlist with it).
        parent.device_worker = worker
        for info in worker.jobs.infos():
            task_cls = type(f"JobTask[{info.name}]", (JobTask,), {
                "name": task_name(info.name), "job": info, "device_worker": worker,
                "__module__": info.module, "__doc__": info.doc,
            })
            app.register_task(task_cls())
        # The collect step is quick and on every fan-out's path: no STARTED state of its own.
        app.task(name=COLLECT_TASK, shared=False, track_started=False)(collect)
        # Exactly the device's queues, each one's list of every level, whatever -Q said.
        app.amqp.queues.select(leveled(worker.setup.queues))
        # One job per slot at once, whatever --concurrency said: the pool and the consumer's
        # prefetch (N messages) are created after every step's __init__ (Blueprint.apply).
        slots = len(worker.slots)
        if parent.concurrency != slots:
            logger.info("%s: concurrency %s -> %d, its slots", worker.device, parent.concurrency, slots)
        parent.concurrency = parent.min_concurrency = slots

    def start(self, parent: Any) -> None:
        pass  # the consumer, started after every worker step, takes the jobs

    def stop(self, parent: Any) -> None:
        # Celery stops the steps in reverse: this wait comes before the heartbeat, the lease
        # keeper and the reaper stop, so a job that ends within its stop timeout is stored
        # with its lease and counted as usual.
        self.worker.begin_stop()
        self.worker.drain()
        self.worker.siblings.close()  # no pack leads here now: its channel for taking members goes

    def terminate(self, parent: Any) -> None:
        pass  # a cold shutdown: no wait (the job processes step ends a running job)


class GroupsStep(bootsteps.StartStopStep):
    """The device's side of device groups (:class:`~tasks.worker.group.GroupKeeper`): close the
    jobs' gate while a group reserves the device, hold it for the oldest once idle. Stopped
    before the jobs step drains: a single job still waiting at the closed gate goes back to its
    queue (the worker is stopping), none starts on a held device."""

    label = "Groups"
    requires = (JobsStep,)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        worker = built(parent, JobsStep).worker
        self.worker = worker
        self.keeper = GroupKeeper(worker.client, worker.device.name, worker.gate)

    def start(self, parent: Any) -> None:
        self.keeper.start()

    def stop(self, parent: Any) -> None:
        self.worker.begin_stop()
        self.keeper.stop()

    terminate = stop


class StopHandlersStep(bootsteps.StartStopStep):
    """A second SIGTERM, or SIGQUIT, stops the worker at once: its jobs back on their queue, its
    job processes killed (:mod:`tasks.worker.shutdown`); installed at start, after Celery's own
    handlers, which the first SIGTERM still reaches."""

    label = "StopHandlers"
    requires = (JobsStep,)

    def start(self, parent: Any) -> None:
        install_stop_handlers(on_exit=built(parent, JobProcessesStep).processes.supervisor.kill_all_now)


class ConsumerReadyStep(bootsteps.StartStopStep):
    """Marks the device worker ready in the registry once the consumer takes tasks (a step of
    the consumer's blueprint, which starts after every worker step)."""

    label = "DeviceWorkerReady"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, parent: Any) -> None:
        built(parent.controller, RegistryStep).heartbeat.update(ready=True)
