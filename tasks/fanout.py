"""Fan-out: one job per device, through a Celery chord, collected into ``{device: entry}``.

::

    import tasks
    handle = tasks.fan_out("train", devices="all", kwargs={"epochs": 10})
    results = handle.get(timeout=600)      # {"cpu0": {...}, "gpu0": {...}}

    handle = tasks.fan_out({"cpu0": ("train", {"model": "mlp"}), "gpu0": ("train", {"model": "cnn"})})

Before anything is sent, the fleet registry is read: a device with no live worker fails the call
at once (:class:`~tasks.errors.DeviceUnavailable`), naming the live devices.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery, chord
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from . import registry
from .devices import DeviceKind
from .entry import error_info, make_entry
from .errors import ConfigError, DeviceUnavailable, FanOutTimeout
from .job import describe_validation_error
from .queues import QueueName, device_queue
from .runner import COLLECT, RUN_JOB

logger = logging.getLogger(__name__)

ALL = "all"


class JobSpec(BaseModel):
    """A job to run: its name and JSON kwargs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)

    @classmethod
    def of(cls, job: JobLike, kwargs: Mapping[str, Any] | None = None) -> JobSpec:
        """Accept ``"train"``, ``("train", {...})``, ``{"name": ..., "kwargs": ...}`` or a JobSpec.

        Raises:
            ConfigError: the spec is malformed; the message says which part.
        """
        try:
            if isinstance(job, JobSpec):
                spec = job if kwargs is None else job.model_copy(update={"kwargs": dict(kwargs)})
            elif isinstance(job, str):
                spec = cls.model_validate({"name": job, "kwargs": dict(kwargs or {})})
            elif isinstance(job, tuple) and len(job) == 2:
                spec = cls.model_validate({"name": job[0], "kwargs": job[1]})
            elif isinstance(job, Mapping):
                spec = cls.model_validate(dict(job))
            else:
                raise ConfigError(
                    f"job {job!r} is not a job spec: give a name, (name, kwargs) or "
                    "{'name': ..., 'kwargs': {...}}"
                )
        except ValidationError as exc:
            raise ConfigError(f"invalid job spec {job!r}: {describe_validation_error(exc)}") from None
        return spec


JobLike = str | JobSpec | tuple[str, Mapping[str, Any]] | Mapping[str, Any]

_clients: dict[str, redis.Redis] = {}


def _registry_client(app: Celery) -> redis.Redis:
    url = str(app.conf.broker_url)
    if url not in _clients:
        _clients[url] = registry.connect(url)
    return _clients[url]


def live_devices(app: Celery | None = None) -> dict[str, dict[str, Any]]:
    """``{device: registry record}`` of the fleet's live workers."""
    return registry.live_workers(_registry_client(app or _default_app()))


def _default_app() -> Celery:
    from .celery_app import app

    return app


def select_devices(devices: str | Sequence[str], live: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Resolve ``"all"``, a kind (``"cpu"``, ``"gpu"``), names, or a comma list to device names.

    Raises:
        DeviceUnavailable: a named device, or every device of a kind, has no live worker.
    """
    wanted = devices.split(",") if isinstance(devices, str) else list(devices)
    wanted = [name.strip() for name in wanted if name and name.strip()]
    if not wanted:
        raise ConfigError(f"devices={devices!r} names no device; use 'all', 'cpu', 'gpu' or names")
    chosen: list[str] = []
    missing: list[str] = []
    for name in wanted:
        if name == ALL or name in (kind.value for kind in DeviceKind):
            matches = [d for d, rec in live.items() if name == ALL or rec.get("kind") == name]
            if not matches:
                missing.append(f"{name} (no live {'worker' if name == ALL else name + ' worker'})")
            chosen.extend(m for m in sorted(matches) if m not in chosen)
        elif name in live:
            if name not in chosen:
                chosen.append(name)
        else:
            missing.append(name)
    if missing:
        raise DeviceUnavailable(missing, live)
    return chosen


class FanOut:
    """A running fan-out. :meth:`get` returns ``{device: entry}``."""

    def __init__(self, app: Celery, plan: dict[str, JobSpec], result: AsyncResult) -> None:
        self.app = app
        self.plan = plan
        self._result = result
        header = result.parent
        self._headers: dict[str, AsyncResult] = dict(zip(plan, header.results, strict=True)) if header else {}

    @property
    def id(self) -> str:
        return str(self._result.id)

    @property
    def devices(self) -> list[str]:
        return list(self.plan)

    def ready(self) -> bool:
        """Whether every device's job has finished (what :meth:`get` waits for)."""
        return all(res.ready() for res in self._headers.values())

    def states(self) -> dict[str, str]:
        """Celery state of each device's job (``PENDING``, ``STARTED``, ``PROGRESS``, ``SUCCESS``...)."""
        return {device: str(res.state) for device, res in self._headers.items()}

    def progress(self) -> dict[str, dict[str, Any]]:
        """The latest progress each device's job reported (empty until it reports)."""
        out: dict[str, dict[str, Any]] = {}
        for device, res in self._headers.items():
            info = res.info if res.state == "PROGRESS" else None
            out[device] = dict(info) if isinstance(info, dict) else {}
        return out

    def get(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Wait for every device and return ``{device: entry}``, in the order of the plan.

        The producer collects the header results itself, as they arrive (one pubsub wait), so a
        fan-out returns as soon as the last device finishes: the chord's ``collect`` step still
        runs on the fleet, off this critical path (it was a whole extra task hop: see
        ``devicefleet bench``, dispatch overhead).

        Raises:
            FanOutTimeout: ``timeout`` seconds passed first; the fan-out goes on running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for res in self._headers.values():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                res.get(timeout=left, propagate=False)
        except CeleryTimeoutError:
            pending = [d for d, res in self._headers.items() if not res.ready()]
            raise FanOutTimeout(timeout or 0.0, pending) from None
        return {device: self._entry_from_header(device) for device in self.plan}

    def _entry_from_header(self, device: str) -> dict[str, Any]:
        res = self._headers.get(device)
        if res is not None and res.successful() and isinstance(res.result, dict):
            return dict(res.result)
        exc = res.result if res is not None else None
        error = error_info(exc) if isinstance(exc, BaseException) else {
            "type": "FanOutError", "message": f"no entry from {device}: state {res.state if res else 'unknown'}"
        }
        return make_entry(device=device, worker=None, output=None, error=error,
                          started=None, finished=None, visibility=None)

    def __repr__(self) -> str:
        return f"<FanOut {self.id} {', '.join(f'{d}:{s.name}' for d, s in self.plan.items())}>"


def fan_out(
    jobs: JobLike | Mapping[str, JobLike],
    devices: str | Sequence[str] = ALL,
    *,
    kwargs: Mapping[str, Any] | None = None,
    app: Celery | None = None,
) -> FanOut:
    """Run a job on each device at the same time; ``.get()`` the handle for ``{device: entry}``.

    Args:
        jobs: one job (a name, ``(name, kwargs)`` or :class:`JobSpec`) for every device of
            ``devices``, or ``{device: job}`` for one model per device.
        devices: ``"all"``, ``"cpu"``, ``"gpu"``, device names, or a comma list of those.
            Ignored when ``jobs`` is a mapping.
        kwargs: kwargs of a single job given by name.
        app: the Celery app to send through; default :data:`tasks.app`.

    Raises:
        DeviceUnavailable: a requested device has no live worker (nothing is sent).
        ConfigError: a job spec is malformed.
    """
    app = app or _default_app()
    live = live_devices(app)
    if isinstance(jobs, Mapping) and not _looks_like_spec(jobs):
        if not jobs:
            raise ConfigError("fan_out({}) names no device")
        kinds = [n for n in jobs if n == ALL or n in (k.value for k in DeviceKind)]
        if kinds:
            raise ConfigError(
                f"fan_out mapping keys must be device names, got {kinds}; use "
                "fan_out(job, devices=...) to run one job on every device of a kind"
            )
        select_devices(list(jobs), live)  # raises DeviceUnavailable before anything is sent
        plan = {device: JobSpec.of(job) for device, job in jobs.items()}
    else:
        spec = JobSpec.of(jobs, kwargs)  # type: ignore[arg-type]
        plan = {device: spec for device in select_devices(devices, live)}
    header = [
        app.signature(
            RUN_JOB,
            kwargs={"device": device, "job": spec.name, "kwargs": spec.kwargs},
            queue=device_queue(device),
        )
        for device, spec in plan.items()
    ]
    body = app.signature(COLLECT, queue=QueueName.FLEET.value)
    result = chord(header, app=app)(body)
    logger.debug("fan-out %s sent to %s", result.id, ", ".join(plan))
    return FanOut(app, plan, result)


def _looks_like_spec(mapping: Mapping[str, Any]) -> bool:
    return set(mapping) <= {"name", "kwargs"} and "name" in mapping
