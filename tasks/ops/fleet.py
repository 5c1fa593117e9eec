"""The local launcher: Redis (embedded unless a URL is given) plus one worker per device.

``devicefleet up`` and ``devicefleet demo`` use :class:`Fleet`; so do the tests. Each worker is a
real process started as users start one (``python -P -m tasks worker cpu0``), in its own session
so that a Ctrl-C in the terminal reaches only the launcher, which then stops the workers in
order: SIGTERM (Celery's warm shutdown: finish the running job, take no new one), then SIGKILL
to the worker's whole process group after ``stop_timeout``, so that a hung job cannot hold the
launcher's stop for longer. If the launcher dies without stopping them (even by SIGKILL), the
kernel kills every child it started (:func:`tasks.core.children.spawn_child`).

A warm stop finishes what it lets finish: the last job of a fan-out to end sends the chord's
collect step to the ``fleet`` queue, which no stopping worker takes any more; so once the workers
are gone, and before Redis stops, the launcher runs those steps itself (:func:`run_left_collects`)
and a producer waiting on the fan-out gets its ``{device: entry}``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from ..core.app import create_app
from ..core.children import spawn_child
from ..core.defaults import (
    FLEET_KILL_STOP_S,
    FLEET_START_TIMEOUT_S,
    FLEET_STOP_TIMEOUT_S,
    FLEET_SUPERVISE_S,
    LEFT_COLLECTS_SCAN,
    LOADER_CORES,
    REDIS_GONE_STOP_S,
    REDIS_RESTART_BACKOFF_S,
)
from ..core.devices import Device, DeviceKind, count_gpus, format_core_list, plan_cores, usable_cores
from ..core.errors import ConfigError, FleetError, RedisServerError
from ..core.hiding import FLOWER_AUTH_ENV, environment_secrets, fleet_secrets, hide_from_children
from ..core.records import FleetDevice, FleetFile
from ..core.registry import connect, live_workers
from ..core.settings import Settings, read_fleet_file, redact_url
from ..core.shadow import python_child
from ..core.stopflag import StopFlag
from ..core.worker_config import load_worker_config
from .monitor import FleetMonitor
from .proc import kill_group, log_tail, wait_until
from .redis_server import EmbeddedRedis

logger = logging.getLogger(__name__)


@dataclass
class WorkerProcess:
    """One device worker the launcher runs."""

    name: str
    cores: list[int]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    #: Where this start's lines begin in the log, which every start of the device appends to.
    log_offset: int = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as ``DEVICEFLEET_*`` variables, so child processes see the same values."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        env[f"DEVICEFLEET_{name.upper()}"] = str(value)
    return env


def default_cpu_workers(gpus: int, cores: int) -> int:
    """Two CPU devices on a host with no GPU (so a fan-out is a parallel one), else one."""
    return 2 if gpus == 0 and cores >= 2 else 1


@dataclass
class Fleet:
    """Redis and the device workers of this host.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    settings: Settings
    cpu_workers: int | None = None
    gpus: int | None = None
    stop_timeout: float = FLEET_STOP_TIMEOUT_S
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Start Flower (``devicefleet up`` does) and the Prometheus exporter with the fleet.
    flower: bool = False
    metrics: bool = True
    redis: EmbeddedRedis | None = None
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    redis_url: str = ""
    monitor: FleetMonitor | None = None
    _stopping: bool = False
    #: Set once a stop has run to its end, so that stopping again (the CLI after start() failed
    #: and stopped the fleet itself) does not restart the embedded Redis it just stopped.
    _stopped: bool = False
    redis_restarts: int = 0
    _redis_retry_at: float = 0.0
    _redis_backoff_s: float = REDIS_RESTART_BACKOFF_S[0]

    # -- start ---------------------------------------------------------------------------------

    def plan(self) -> dict[str, list[int]]:
        """``{device: cores}`` for the workers this fleet runs."""
        cores = usable_cores()
        gpus = self.gpus if self.gpus is not None else self.settings.gpus
        if gpus is None:
            gpus = count_gpus()
        cpus = self.cpu_workers or self.settings.cpu_workers or default_cpu_workers(gpus, len(cores))
        loader = LOADER_CORES
        if gpus:
            loader = load_worker_config(self.settings.worker_configs_path, Device(DeviceKind.GPU, 0)).loader_cores
        plan = plan_cores(cores, cpus, gpus, loader)
        for name in plan:  # fail now, with the file's name, not in a worker's log
            load_worker_config(self.settings.worker_configs_path, Device.parse(name))
        return plan

    def start(self, timeout: float = FLEET_START_TIMEOUT_S) -> Fleet:
        """Start Redis (unless ``settings.redis_url``) and every worker; wait until all are ready.

        Raises:
            FleetError: a fleet already runs for this state dir, or a worker failed to start
                (the message has the tail of its log).
        """
        existing = read_fleet_file(self.settings.fleet_file)
        if existing is not None:
            raise FleetError(
                f"a fleet is already running for state dir {self.settings.state_dir} "
                f"(launcher pid {existing.pid}); stop it first, or set "
                "DEVICEFLEET_STATE_DIR to another folder"
            )
        plan = self.plan()
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.settings.redis_url:
                self.redis_url = self.settings.redis_url
            else:
                self.redis = EmbeddedRedis(
                    self.settings.state_dir / "redis",
                    port=self.settings.embedded_redis_port,
                    binary=self.settings.redis_server,
                )
                self.redis.start()
                self.redis_url = self.redis.url
            # The launcher holds the URL (in its environment too, when given there), as Flower and
            # the workers it starts do: each of them hides it from the jobs of its user.
            hide_from_children([*fleet_secrets(self.redis_url), *environment_secrets()])
            logs = self.settings.state_dir / "logs"
            logs.mkdir(exist_ok=True)
            # Before the workers, so that Flower sees them come online.
            self.monitor = FleetMonitor(self.settings, self.redis_url, flower=self.flower,
                                        metrics=self.metrics, extra_env=self.extra_env).start()
            for name, cores in plan.items():
                worker = WorkerProcess(name=name, cores=cores, log=logs / f"{name}.log")
                self.workers[name] = worker
                self._spawn(worker)
            self._write_fleet_file()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self, worker: WorkerProcess) -> dict[str, str]:
        # Flower's login is Flower's alone: a worker has no use for it, its jobs even less.
        env = {name: value for name, value in os.environ.items() if name != FLOWER_AUTH_ENV}
        env.update(settings_env(self.settings))
        env.update({
            "DEVICEFLEET_REDIS_URL": self.redis_url,
            "DEVICEFLEET_CORES": format_core_list(worker.cores),
            "CUDA_VISIBLE_DEVICES": Device.parse(worker.name).cuda_visible_devices,
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        return env

    def _spawn(self, worker: WorkerProcess) -> None:
        # `python -P -m tasks worker NAME` with this package's folder first on PYTHONPATH: a
        # tasks.py or tasks/ in the user's folder is never the worker (tasks.core.shadow).
        argv, env = python_child("tasks", "worker", worker.name, env=self._env(worker))
        with open(worker.log, "ab") as log:
            worker.log_offset = log.seek(0, os.SEEK_END)
            worker.process = spawn_child(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        worker.started_at = time.time()
        logger.info("started %s (pid %d, cores %s)", worker.name, worker.process.pid,
                    format_core_list(worker.cores))

    def _write_fleet_file(self) -> None:
        info = FleetFile(
            pid=os.getpid(),
            redis_url=self.redis_url,
            embedded_redis=self.redis is not None,
            devices={name: FleetDevice(cores=w.cores, log=str(w.log)) for name, w in self.workers.items()},
            started_at=time.time(),
            **(self.monitor.describe() if self.monitor else {}),
        )
        path = self.settings.fleet_file
        tmp = path.with_suffix(".tmp")
        # The file holds the Redis password: readable by its owner only.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(info.model_dump_json(indent=2))
        os.replace(tmp, path)

    def wait_ready(self, timeout: float = FLEET_START_TIMEOUT_S, names: list[str] | None = None) -> None:
        """Wait until each worker has joined the registry and is consuming.

        Raises:
            FleetError: a worker exited, or ``timeout`` passed first.
        """
        wanted = set(names or self.workers)
        pending = set(wanted)
        client = connect(self.redis_url)

        def all_ready() -> bool:
            live = live_workers(client)
            pending.clear()
            pending.update(
                name for name in wanted
                if not (name in live and live[name].ready
                        and live[name].pid == self.workers[name].process.pid)  # type: ignore[union-attr]
            )
            for name in sorted(pending):
                worker = self.workers[name]
                if not worker.alive:
                    code = worker.process.returncode if worker.process else None
                    # Exit code 2 is a configuration error (a bad setting, an allowlisted job
                    # module that cannot be imported): the fleet cannot start as configured.
                    error = ConfigError if code == 2 else FleetError
                    raise error(
                        f"worker {name} exited with code {code} before joining the fleet; this start's "
                        f"log ({worker.log}):\n{log_tail(worker.log, since=worker.log_offset)}"
                    )
            return not pending

        try:
            wait_until(all_ready, timeout, f"workers {', '.join(sorted(wanted))} to join the registry",
                       detail=lambda: f"not ready: {', '.join(sorted(pending))}; see their logs in "
                                      f"{self.settings.state_dir / 'logs'}")
        finally:
            client.close()

    # -- run -----------------------------------------------------------------------------------

    def app(self) -> Celery:
        """A Celery app connected to this fleet, for producers in this process."""
        return create_app(self.settings.model_copy(update={"redis_url": self.redis_url}))

    def supervise(self, stop: threading.Event | StopFlag, poll_s: float = FLEET_SUPERVISE_S) -> None:
        """Restart any worker that dies, as systemd's ``Restart=on-failure`` would, and the
        embedded Redis if it dies (on its port, from its append-only file), until ``stop``."""
        while not stop.wait(poll_s):
            if not self._stopping and self.redis_down() and time.monotonic() >= self._redis_retry_at:
                self._restart_redis()
            for worker in self.workers.values():
                if self._stopping or worker.alive or worker.process is None:
                    continue
                code = worker.process.returncode
                worker.restarts += 1
                logger.warning("%s exited with code %s; restarting it (restart %d)",
                               worker.name, code, worker.restarts)
                self._spawn(worker)

    def redis_down(self) -> bool:
        """Whether the embedded redis-server has exited (it is reaped here: no zombie stays)."""
        process = self.redis.process if self.redis is not None else None
        return process is not None and process.poll() is not None

    def _restart_redis(self) -> bool:
        """Start the embedded Redis again; on failure, try again after a doubling back-off."""
        assert self.redis is not None and self.redis.process is not None
        self.redis_restarts += 1
        logger.warning("redis-server exited with code %s; restarting it on port %d from its append-only file "
                       "(restart %d)", self.redis.process.returncode, self.redis.port, self.redis_restarts)
        try:
            self.redis.start()
        except RedisServerError as exc:
            self._redis_retry_at = time.monotonic() + self._redis_backoff_s
            logger.error("%s; trying again in %g s", exc, self._redis_backoff_s)
            self._redis_backoff_s = min(2 * self._redis_backoff_s, REDIS_RESTART_BACKOFF_S[1])
            return False
        self._redis_backoff_s = REDIS_RESTART_BACKOFF_S[0]
        return True

    def describe(self) -> dict[str, Any]:
        return {
            "redis_url": redact_url(self.redis_url),
            "embedded_redis": self.redis is not None,
            "state_dir": str(self.settings.state_dir),
            "workers": {
                name: {"pid": w.process.pid if w.process else None, "cores": format_core_list(w.cores),
                       "log": str(w.log), "restarts": w.restarts}
                for name, w in self.workers.items()
            },
            "redis_restarts": self.redis_restarts,
            **(self.monitor.describe() if self.monitor else {}),
        }

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, timeout: float | None = None) -> None:
        """Warm-stop every worker (SIGTERM), kill those still running after ``timeout`` (SIGKILL to
        the worker's process group), then stop Flower and Redis. Once stopped, a no-op."""
        if self._stopped:
            return
        self._stopping = True
        timeout = self.stop_timeout if timeout is None else timeout
        # Running jobs need Redis to store their results: bring a dead embedded one back first,
        # and if it will not come back, do not wait the full timeout for workers that cannot.
        if self.redis_down() and not self._restart_redis():
            timeout = min(timeout, REDIS_GONE_STOP_S)
        running = [w for w in self.workers.values() if w.alive]
        for worker in running:
            worker.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        for worker in running:
            assert worker.process is not None
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s still running after %g s; killing it", worker.name, timeout)
                kill_group(worker.process)
        if self.redis_url and not self.redis_down() and self._redis_answers():
            try:
                with self.app() as app:
                    run_left_collects(app)
            except Exception as exc:  # noqa: BLE001  (a stop goes on: the producers wait on, as before)
                logger.warning("could not run the fan-outs' collect steps left by the stop: %s", exc)
        # The fleet file goes first: a producer waiting on this fleet that then loses Redis
        # knows the fleet stopped for good (tasks.ops.fleet_lost), rather than retrying.
        info = read_fleet_file(self.settings.fleet_file)
        if info is not None and info.pid == os.getpid():
            self.settings.fleet_file.unlink(missing_ok=True)
        if self.monitor is not None:
            self.monitor.stop()
        if self.redis is not None:
            self.redis.stop()
        self._stopped = True

    def _redis_answers(self) -> bool:
        """Whether the fleet's Redis answers a PING now (once: no retries through an outage)."""
        try:
            with connect(self.redis_url) as client:
                return bool(client.ping())
        except (redis.RedisError, OSError):
            return False

    def kill(self) -> None:
        """Stop everything at once (a second Ctrl-C)."""
        for worker in self.workers.values():
            if worker.alive:
                kill_group(worker.process)  # type: ignore[arg-type]
        self.stop(timeout=FLEET_KILL_STOP_S)

    def __enter__(self) -> Fleet:
        if not self.workers:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self.kill()  # interrupted (Ctrl-C, or SIGTERM to demo/bench): no waiting on jobs
        else:
            self.stop()


def run_left_collects(app: Celery, scan: int = LEFT_COLLECTS_SCAN) -> list[str]:
    """Run here the fan-outs' collect steps waiting on the ``fleet`` queue (its lists of every
    level), as a worker would:
    each one's ``{device: entry}`` (a fold of the entries its message carries) is stored as its
    result, and its message acknowledged. Every other message goes back to the queue.

    For the launcher's stop, once its workers are gone (see the module's docstring); a worker
    that still runs elsewhere on the same Redis would have taken them all the same.

    Returns:
        The task ids of the collect steps run.
    """
    from ..core.job import COLLECT_TASK
    from ..core.queue_lists import leveled
    from ..core.queues import QueueName
    from ..worker.runner import collect

    done: list[str] = []
    with app.connection_for_write() as connection, connection.channel() as channel:
        for name in leveled([QueueName.FLEET.value]):  # a collect step goes at its fan-out's level
            others = []
            queue = app.amqp.queues[name](channel)
            for _ in range(scan):
                message = queue.get(no_ack=False)
                if message is None:
                    break
                if message.headers.get("task") != COLLECT_TASK:
                    others.append(message)
                    continue
                task_id = str(message.headers["id"])
                args, kwargs, _embed = message.decode()
                app.backend.mark_as_done(task_id, collect(*args, **kwargs))
                message.ack()
                done.append(task_id)
            for message in others:
                message.reject(requeue=True)
    if done:
        logger.info("ran %d collect step(s) the stop left queued: %s", len(done), ", ".join(done))
    return done
