"""Fan-out: one job per device, through a Celery chord, collected into ``{device: entry}``.

::

    import tasks
    handle = tasks.fan_out("train", devices="all", kwargs={"epochs": 10})
    results = handle.get(timeout=600)      # {"cpu0": {...}, "gpu0": {...}}

    handle = tasks.fan_out({"cpu0": ("train", {"model": "mlp"}), "gpu0": ("train", {"model": "cnn"})})

Each device's job is the Celery task ``devicefleet.<job>`` on the queue ``device.<name>``; the
chord's body, ``devicefleet.collect``, folds the entries into the dict that :meth:`FanOut.get`
returns. A failed job's task ends in FAILURE and its error entry is still collected
(:mod:`tasks.core.backend`).

Before anything is sent, the fleet registry is read: a device with no live worker fails the call
at once (:class:`~tasks.core.errors.DeviceUnavailable`), naming the live devices.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery, chord
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from ..core import keys
from ..core.app import redis_url_of
from ..core.devices import DeviceKind
from ..core.errors import ConfigError, DeviceUnavailable, FanOutTimeout, UnknownJob
from ..core.job import COLLECT_TASK, task_name
from ..core.keys import OPTIONS_HEADER
from ..core.queues import QueueName, device_queue
from ..core.records import JobOptions, WorkerRecord
from ..core.registry import connect, live_workers
from ..core.validation import describe_validation_error

logger = logging.getLogger(__name__)

ALL = "all"


class JobSpec(BaseModel):
    """A job to run: its name, its JSON kwargs, and options that are not its kwargs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    options: JobOptions = Field(default_factory=JobOptions)

    @classmethod
    def of(cls, job: JobLike, kwargs: Mapping[str, Any] | None = None,
           options: JobOptions | Mapping[str, Any] | None = None) -> JobSpec:
        """Accept ``"train"``, ``("train", {...})``, ``{"name": ..., "kwargs": ...}`` or a JobSpec.

        Raises:
            ConfigError: the spec is malformed; the message says which part.
        """
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ConfigError(
                f"kwargs={kwargs!r} is not a mapping: pass the job's kwargs as a dict, "
                "e.g. kwargs={'epochs': 3}"
            )
        if options is not None and not isinstance(options, (JobOptions, Mapping)):
            raise ConfigError(f"options={options!r} is not a mapping: e.g. options={{'fallback': 'cpu'}}")
        update: dict[str, Any] = {}
        if kwargs is not None:
            update["kwargs"] = dict(kwargs)
        if options is not None:
            update["options"] = options
        try:
            if isinstance(job, JobSpec):
                spec = cls.model_validate({**job.model_dump(), **update}) if update else job
            elif isinstance(job, str):
                spec = cls.model_validate({"name": job, **update})
            elif isinstance(job, tuple) and len(job) == 2:
                spec = cls.model_validate({"name": job[0], "kwargs": job[1], **update})
            elif isinstance(job, Mapping):
                spec = cls.model_validate({**dict(job), **update})
            else:
                raise ConfigError(
                    f"job {job!r} is not a job spec: give a name, (name, kwargs) or "
                    "{'name': ..., 'kwargs': {...}}"
                )
        except ValidationError as exc:
            raise ConfigError(f"invalid job spec {job!r}: {describe_validation_error(exc)}") from None
        return spec

    def signature(self, app: Celery, queue: str) -> Any:
        """The Celery signature that runs this job from ``queue``."""
        headers = {} if self.options.is_default else {OPTIONS_HEADER: self.options.to_dict()}
        return app.signature(task_name(self.name), kwargs=self.kwargs, queue=queue, headers=headers)


JobLike = str | JobSpec | tuple[str, Mapping[str, Any]] | Mapping[str, Any]

#: One registry client per Redis URL, kept for the process's life (a fan-out reads the registry).
_clients: dict[str, redis.Redis] = {}


def registry_client(app: Celery) -> redis.Redis:
    url = redis_url_of(app)
    if url not in _clients:
        _clients[url] = connect(url)
    return _clients[url]


def live_devices(app: Celery | None = None) -> dict[str, WorkerRecord]:
    """``{device: registry record}`` of the fleet's live workers."""
    return live_workers(registry_client(app or _default_app()))


def latest_reports(app: Celery, task_ids: list[str]) -> dict[str, dict[str, Any]]:
    """``{task id: its latest progress report}`` of the jobs that reported (one ``MGET``)."""
    raw = registry_client(app).mget([keys.progress(task_id) for task_id in task_ids]) if task_ids else []
    out: dict[str, dict[str, Any]] = {}
    for task_id, value in zip(task_ids, raw, strict=True):
        try:
            report = json.loads(value) if value else None
        except ValueError:
            report = None
        if isinstance(report, dict):
            out[task_id] = report
    return out


def _default_app() -> Celery:
    from ..core.app import app

    return app


def select_devices(devices: str | Sequence[str], live: Mapping[str, WorkerRecord]) -> list[str]:
    """Resolve ``"all"``, a kind (``"cpu"``, ``"gpu"``), names, or a comma list to device names.

    Raises:
        DeviceUnavailable: a named device, or every device of a kind, has no live worker.
        ConfigError: ``devices`` names nothing.
    """
    wanted = devices.split(",") if isinstance(devices, str) else list(devices)
    wanted = [name.strip() for name in wanted if name and name.strip()]
    if not wanted:
        raise ConfigError(f"devices={devices!r} names no device; use 'all', 'cpu', 'gpu' or names")
    chosen: list[str] = []
    missing: list[str] = []
    for name in wanted:
        if name == ALL or name in (kind.value for kind in DeviceKind):
            matches = [d for d, rec in live.items() if name == ALL or rec.kind == name]
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


def check_jobs(plan: Mapping[str, JobSpec], live: Mapping[str, WorkerRecord]) -> None:
    """Check each device's job against the jobs its worker advertises, before anything is sent.

    Raises:
        UnknownJob: a device's worker does not run that job; the message suggests a close name.
    """
    missing: dict[str, list[str]] = {}
    for device, spec in plan.items():
        if spec.name not in live[device].jobs:
            missing.setdefault(spec.name, []).append(device)
    if not missing:
        return
    name, where = next(iter(missing.items()))
    offered = sorted({job for device in where for job in live[device].jobs})
    close = difflib.get_close_matches(name, offered, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownJob(
        f"unknown job {name!r} on {', '.join(where)}: {hint}the workers there run "
        f"{', '.join(offered) or 'no jobs'}; to add a job, add the module that defines it to "
        "DEVICEFLEET_JOB_MODULES on the workers (nothing was sent)"
    )


class FanOut:
    """A running fan-out. :meth:`get` returns ``{device: entry}``, the dict the chord collected."""

    def __init__(self, app: Celery, plan: dict[str, JobSpec], result: AsyncResult) -> None:
        self.app = app
        self.plan = plan
        self._result = result
        header = result.parent
        self._jobs: dict[str, AsyncResult] = dict(zip(plan, header.results, strict=True)) if header else {}

    @property
    def id(self) -> str:
        """The id of the chord's collect task, whose result is the dict."""
        return str(self._result.id)

    @property
    def group_id(self) -> str:
        """The id of the group of device jobs (Celery's ``request.group`` in each job); its first
        8 characters name the fan-out's TensorBoard runs, ``<job>-<group_id[:8]>/<device>``."""
        header = self._result.parent
        return str(header.id) if header is not None else self.id

    @property
    def devices(self) -> list[str]:
        return list(self.plan)

    @property
    def task_ids(self) -> dict[str, str]:
        """``{device: Celery task id}`` of each device's job (for ``AsyncResult``, Flower, logs)."""
        return {device: str(res.id) for device, res in self._jobs.items()}

    def results(self) -> dict[str, AsyncResult]:
        """``{device: AsyncResult}`` of each device's job."""
        return dict(self._jobs)

    def ready(self) -> bool:
        """Whether every device's job has finished."""
        return all(res.ready() for res in self._jobs.values())

    def states(self) -> dict[str, str]:
        """Celery state of each device's job (``PENDING``, ``STARTED``, ``PROGRESS``, ``SUCCESS``,
        ``FAILURE``...)."""
        return {device: str(res.state) for device, res in self._jobs.items()}

    def progress(self) -> dict[str, dict[str, Any]]:
        """The latest progress each device's job reported: ``{}`` until it reports, and its
        last report once it has finished (one Redis round trip for every device)."""
        reports = latest_reports(self.app, [str(res.id) for res in self._jobs.values()])
        return {device: reports.get(str(res.id), {}) for device, res in self._jobs.items()}

    def cancel(self) -> None:
        """Cancel the fan-out: a job not started yet never starts, a running one stops at its
        next ``ctx.progress()`` call (cooperative: a job that never reports runs to its end).
        Their entries say ``cancelled``; :meth:`get` still returns every device."""
        pending = [str(res.id) for res in self._jobs.values() if not res.ready()]
        if pending:
            self.app.control.revoke(pending)
            logger.info("fan-out %s: cancelled %s", self.id, ", ".join(pending))

    def get(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Wait for the chord and return ``{device: entry}``, in the order of the plan.

        Raises:
            FanOutTimeout: ``timeout`` seconds passed first; the fan-out goes on running.
        """
        try:
            # A failed device is an error entry in the collected dict, not an error of the call.
            collected = self._result.get(timeout=timeout, follow_parents=False)
        except CeleryTimeoutError:
            pending = [d for d, res in self._jobs.items() if not res.ready()]
            raise FanOutTimeout(timeout or 0.0, pending) from None
        return {device: collected[device] for device in self.plan}

    def __repr__(self) -> str:
        return f"<FanOut {self.id} {', '.join(f'{d}:{s.name}' for d, s in self.plan.items())}>"


def fan_out(
    jobs: JobLike | Mapping[str, JobLike],
    devices: str | Sequence[str] = ALL,
    *,
    kwargs: Mapping[str, Any] | None = None,
    options: JobOptions | Mapping[str, Any] | None = None,
    app: Celery | None = None,
) -> FanOut:
    """Run a job on each device at the same time; ``.get()`` the handle for ``{device: entry}``.

    Args:
        jobs: one job (a name, ``(name, kwargs)`` or :class:`JobSpec`) for every device of
            ``devices``, or ``{device: job}`` for one model per device.
        devices: ``"all"``, ``"cpu"``, ``"gpu"``, device names, or a comma list of those.
            Ignored when ``jobs`` is a mapping.
        kwargs: kwargs of a single job given by name.
        options: :class:`~tasks.core.records.JobOptions` of a single job (e.g.
            ``{"fallback": "cpu"}``); they travel beside the kwargs.
        app: the Celery app to send through; default ``tasks.app``.

    Raises:
        DeviceUnavailable: a requested device has no live worker (nothing is sent).
        ConfigError: a job spec is malformed.
        UnknownJob: a device's worker does not run the job (nothing is sent).
    """
    app = app or _default_app()
    if isinstance(jobs, Mapping) and not _looks_like_spec(jobs):
        if not jobs:
            raise ConfigError("fan_out({}) names no device")
        kinds = [n for n in jobs if n == ALL or n in (k.value for k in DeviceKind)]
        if kinds:
            raise ConfigError(
                f"fan_out mapping keys must be device names, got {kinds}; use "
                "fan_out(job, devices=...) to run one job on every device of a kind"
            )
        plan = {device: JobSpec.of(job) for device, job in jobs.items()}
        live = live_devices(app)
        select_devices(list(jobs), live)  # raises DeviceUnavailable before anything is sent
    else:
        spec = JobSpec.of(jobs, kwargs, options)  # type: ignore[arg-type]
        live = live_devices(app)
        plan = {device: spec for device in select_devices(devices, live)}
    check_jobs(plan, live)
    header = [spec.signature(app, device_queue(device)) for device, spec in plan.items()]
    body = app.signature(COLLECT_TASK, kwargs={"devices": list(plan)}, queue=QueueName.FLEET.value)
    result = chord(header, app=app)(body)
    logger.debug("fan-out %s sent to %s", result.id, ", ".join(plan))
    return FanOut(app, plan, result)


def _looks_like_spec(mapping: Mapping[str, Any]) -> bool:
    return set(mapping) <= {"name", "kwargs", "options"} and "name" in mapping
