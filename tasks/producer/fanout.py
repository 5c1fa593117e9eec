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

With ``distributed=True`` the devices' jobs are the ranks of one ``torch.distributed`` job
(rank ``i`` on the ``i``-th device): every message carries the gang's
:class:`~tasks.core.records.GangSpec`, and the workers assemble the gang
(:mod:`tasks.worker.gang`; each rank's process group in :mod:`tasks.jobproc.rank`). A gang's ranks are sent under one Redis lock, so on every
device's queue one gang's ranks come before the next gang's.
"""

from __future__ import annotations

import difflib
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery, chord
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from celery.states import READY_STATES, SUCCESS
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from ..core import keys
from ..core.arguments import check_arguments
from ..core.commands import COMMAND_JOB, check_command, command_params
from ..core.defaults import GANG_SEND_WAIT_S, GROUP_CLAIM_TTL_S, RESULT_EXPIRES_S
from ..core.device_state import DeviceState, out_of_service
from ..core.devices import DeviceKind
from ..core.errors import (
    ConfigError,
    DeviceUnavailable,
    FanOutError,
    FanOutTimeout,
    GroupUnavailable,
    PlacementUnavailable,
    UnknownJob,
)
from ..core.group_reservation import release_unclaimed, reserve_at_send
from ..core.groups import GROUP_SEPARATOR, GroupChoice, check_group_size, check_named_group, choose_groups, key_devices
from ..core.job import COLLECT_TASK, task_name
from ..core.keys import CANCEL_REQUESTS, OPTIONS_HEADER
from ..core.placement import CLOSEST_SHOWN, Constraints, place
from ..core.priority import Level, check_user, os_user, parse_level
from ..core.queue_lists import level_queue
from ..core.queues import QueueName, device_queue, key_device, slot_key
from ..core.records import DistBackend, DistributedOptions, GangSpec, GroupSpec, JobOptions, WorkerRecord
from ..core.registry import job_schemas, live_workers
from ..core.users import Credentials, cancel_request, owned_task_id
from ..core.validation import describe_validation_error
from .connections import Connections, default_app
from .handle import JobHandle
from .listener import RECHECK_S

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

    @classmethod
    def sharing(cls, job: JobLike, kwargs: Mapping[str, Any] | None) -> JobSpec:
        """``job`` with ``kwargs`` added to its own (a sweep's or a study's shared kwargs: a
        command keeps its argv).

        Raises:
            ConfigError: the spec is malformed.
        """
        base = cls.of(job)
        return cls.of(base, {**base.kwargs, **kwargs}) if kwargs else base

    @property
    def level(self) -> Level:
        """The job's level (its options' ``priority``)."""
        return self.options.priority

    def signature(self, app: Celery, queue: str) -> Any:
        """The Celery signature that runs this job from ``queue``'s list of the job's level,
        with its options (the user filled in: :func:`sender_of`). Flower shows the level and the
        user as the task's args (a job takes kwargs only)."""
        options = self.options if self.options.user else self.options.model_copy(update={"user": sender_of(app)})
        # A user's job: a task id of theirs, so its result is a key only they read (tasks.core.users).
        owned = {"task_id": owned_task_id(options.user)} if options.user and sends_as_user(app) else {}
        return app.signature(task_name(self.name), kwargs=self.kwargs, queue=level_queue(queue, options.priority),
                             headers={OPTIONS_HEADER: options.to_dict()},
                             argsrepr=f"priority={options.priority.value} user={options.user}", **owned)


JobLike = str | JobSpec | tuple[str, Mapping[str, Any]] | Mapping[str, Any]


def prioritized(job: JobLike, priority: Level | str | None = None, user: str | None = None) -> JobSpec:
    """``job`` as a :class:`JobSpec` at level ``priority`` and sent as ``user`` (each where given;
    otherwise as the job's own options say).

    Raises:
        ConfigError: a malformed spec, or ``priority`` is not a level or ``user`` not a user name.
    """
    spec = JobSpec.of(job)
    update: dict[str, Any] = {}
    if priority is not None:
        update["priority"] = parse_level(priority)
    if user is not None:
        update["user"] = check_user(user)
    return spec.model_copy(update={"options": spec.options.model_copy(update=update)}) if update else spec


def sends_as_user(app: Celery) -> bool:
    """Whether ``app`` sends with a user's credentials (:mod:`tasks.core.users`)."""
    return credentials_of(app) is not None


def credentials_of(app: Celery) -> Credentials | None:
    """The user's credentials ``app`` sends with, or None: the fleet's own password."""
    settings = getattr(app, "fleet_settings", None)
    return settings.user_credentials if settings is not None else None


def revoke(app: Celery, client: Any, task_ids: list[str], *, store: bool = False) -> None:
    """Cancel jobs ``task_ids``: Celery's revoke, or, sent with a user's credentials (which are
    denied Celery's control broadcast), the user's signed requests that a worker checks and sends
    on (:mod:`tasks.worker.cancels`); with ``store``, the relay also stores ``REVOKED`` for those
    that do not run (a sweep's queued trials: the user writes no result key)."""
    credentials = credentials_of(app)
    if credentials is None:
        app.control.revoke(task_ids)
        return
    client.lpush(CANCEL_REQUESTS, *(cancel_request(credentials, task_id, store=store).to_json() for task_id in task_ids))


def sender_of(app: Celery) -> str:
    """The user of the jobs ``app`` sends that name none: its settings' ``user``, else the OS
    user (:attr:`tasks.core.settings.Settings.sender`)."""
    settings = getattr(app, "fleet_settings", None)
    return settings.sender if settings is not None else os_user()


def registry_client(app: Celery) -> redis.Redis:
    """The blocking Redis client of ``app``'s default connections (:meth:`Connections.of`)."""
    return Connections.of(app).redis


def live_devices(app: Celery | None = None, *, client: Connections | None = None) -> dict[str, WorkerRecord]:
    """``{device: registry record}`` of the fleet's live workers."""
    return live_workers((client or Connections.of(app)).redis)


def _default_app() -> Celery:
    return default_app()


#: What ``devices`` may name besides devices: ``"all"`` and each kind (``"cpu"``, ``"gpu"``).
_KIND_NAMES = frozenset({ALL, *(kind.value for kind in DeviceKind)})


def select_devices(devices: str | Sequence[str], live: Mapping[str, WorkerRecord],
                   out: Mapping[str, DeviceState] | None = None) -> list[str]:
    """Resolve ``"all"``, a kind (``"cpu"``, ``"gpu"``), names, or a comma list to device names.
    A device in ``out`` (out of service: drained, quarantined, suspect) counts as missing: a
    kind or ``"all"`` leaves it out, a name of it fails as a device that is not there does.

    Raises:
        DeviceUnavailable: a named device, or every device of a kind, has no live worker in service.
        ConfigError: ``devices`` names nothing.
    """
    wanted = _wanted(devices)
    if not wanted:
        raise ConfigError(f"devices={devices!r} names no device; use 'all', 'cpu', 'gpu' or names")
    out = out or {}
    serving = {device: record for device, record in live.items() if device not in out}
    chosen: list[str] = []
    missing: list[str] = []
    for name in wanted:
        if name in _KIND_NAMES:
            matches = [d for d, rec in serving.items() if name == ALL or rec.kind == name]
            if not matches:
                missing.append(f"{name} (no live {'worker' if name == ALL else name + ' worker'}"
                               f"{' in service' if out else ''})")
            chosen.extend(m for m in sorted(matches) if m not in chosen)
        elif name in out:
            state = out[name]
            missing.append(f"{name} ({state.state}: {state.reason or 'no reason given'}, by {state.by or '?'})")
        elif name in live:
            if name not in chosen:
                chosen.append(name)
        else:
            missing.append(name)
    if missing:
        raise DeviceUnavailable(missing, serving)
    return chosen


def constrained(spec: JobSpec, constraints: Constraints | Mapping[str, Any] | None) -> JobSpec:
    """``spec`` with ``constraints`` in its options (its options' own when none are given): they
    travel with the job, so a worker whose device does not match hands it back.

    Raises:
        ConfigError: an unknown constraint or a bad value (:meth:`Constraints.parse`).
    """
    parsed = Constraints.parse(constraints)
    if parsed is None or parsed == spec.options.constraints:
        return spec
    return spec.model_copy(update={"options": spec.options.model_copy(update={"constraints": parsed})})


def serving_devices(client: redis.Redis, devices: str | Sequence[str], live: Mapping[str, WorkerRecord]) -> list[str]:
    """:func:`select_devices` with the devices out of service now read from ``client`` (one ``HMGET``)."""
    return select_devices(devices, live, out_of_service(client, list(live)))


def serving_placed(client: redis.Redis, devices: str | Sequence[str], live: Mapping[str, WorkerRecord],
                   spec: JobSpec) -> list[str]:
    """The devices of ``devices`` that are in service (one ``HMGET``) and meet ``spec``'s
    constraints: a device named outright but out of service is refused as missing, as by
    :func:`serving_devices`; with constraints, the devices of ``all`` or a kind are placed among
    all of them, so that a refusal names one out of service as such (:func:`tasks.core.placement.place`),
    and each device named outright must meet them.

    Raises:
        DeviceUnavailable: a named device is not live or out of service.
        PlacementUnavailable: no device meets the constraints, or one named outright does not
            (nothing was sent).
    """
    out = out_of_service(client, list(live))
    serving = select_devices(devices, live, out)
    constraints = spec.options.constraints
    if constraints is None:
        return serving
    return place(select_devices(devices, live), live, constraints, out, named=named_devices(devices))


def _wanted(devices: str | Sequence[str]) -> list[str]:
    """The parts of ``devices`` (a comma list or names), stripped, the empty ones left out."""
    parts = devices.split(",") if isinstance(devices, str) else list(devices)
    return [name.strip() for name in parts if name and name.strip()]


def named_devices(devices: str | Sequence[str]) -> list[str]:
    """The devices ``devices`` names outright: its names, not its kinds or ``"all"``."""
    return [name for name in _wanted(devices) if name not in _KIND_NAMES]


def placed_groups(chosen: Sequence[str], live: Mapping[str, WorkerRecord], size: int, spec: JobSpec,
                  devices: str | Sequence[str]) -> list[GroupChoice]:
    """The device groups of ``size`` among ``chosen`` (the devices :func:`serving_placed` kept of
    ``devices``), as :func:`~tasks.core.groups.choose_groups` makes them. When ``spec`` has
    constraints and its matching devices make no group, the refusal names the constraints and,
    for each device of ``devices``, what it lacks, or that too few others of its kind on its
    host match with it: a group's constraints hold for every device of it.

    Raises:
        GroupUnavailable: no host has ``size`` devices of one kind among ``chosen`` (no constraints).
        PlacementUnavailable: the same, with constraints (nothing was sent).
    """
    constraints = spec.options.constraints
    try:
        return choose_groups(chosen, live, size)
    except GroupUnavailable:
        if constraints is None:
            raise
    placed_set = set(chosen)
    unmet: dict[str, list[str]] = {}
    for device in select_devices(devices, live):
        record = live[device]
        if device in placed_set:
            peers = sum(1 for d in chosen if (live[d].host, live[d].kind) == (record.host, record.kind))
            unmet[device] = [f"meets them; matching {record.kind} devices on {record.host}: {peers} of the {size} "
                              "a group needs"]
        else:
            unmet[device] = constraints.unmet(record) or ["out of service"]
    # The devices that match first (what the group lacks is their peers), then the nearest misses.
    closest = sorted(unmet, key=lambda d: (d not in placed_set, len(unmet[d]), d))[:CLOSEST_SHOWN]
    raise PlacementUnavailable(f"{constraints.describe()} for a group of {size} devices of one kind on one host",
                               {device: "; ".join(unmet[device]) for device in closest}, len(unmet)) from None


def check_jobs(plan: Mapping[str, JobSpec], live: Mapping[str, WorkerRecord]) -> None:
    """Check each device's job against the jobs its worker advertises, before anything is sent.

    Raises:
        UnknownJob: a device's worker does not run that job; the message suggests a close name.
        CommandRefused: a command's program or folder is not one its device allows.
        ConfigError: a command's kwargs are malformed.
    """
    missing: dict[str, list[str]] = {}
    for device, spec in plan.items():
        if spec.name == COMMAND_JOB:  # the device's rules say more than its list of jobs
            check_command(command_params(spec.kwargs), device, live[device].commands)
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


def check_kwargs(client: redis.Redis, runs: Sequence[tuple[str, JobSpec, str]],
                 sampled: Sequence[str] = ()) -> None:
    """Check each run's kwargs against its job's params schema as the device's worker published
    it (:mod:`tasks.core.arguments`), before anything is sent: one round trip for the schemas,
    each distinct schema checked once per spec (workers that agree cost one check).

    Args:
        runs: ``(device, spec, where)``: ``spec`` would run on ``device``; ``where`` names it in
            the message (a sweep's ``trial 3``), or is empty.
        sampled: params a study samples: not missing, and not checked (the study's).

    Raises:
        InvalidJobArguments: a spec's kwargs are refused; one line naming the job, each bad
            field with its value and a close name. A job without a published schema (a worker
            from before schemas, a command) is not checked here: its worker checks it.
    """
    runs = [run for run in runs if run[1].name != COMMAND_JOB]  # a command's rules: check_jobs
    if not runs:
        return
    schemas = job_schemas(client, [(device, spec.name) for device, spec, _ in runs])
    checked: set[tuple[str, int, str]] = set()
    parsed: dict[str, dict[str, Any]] = {}
    for device, spec, where in runs:
        raw = schemas.get((device, spec.name))
        if raw is None or (raw, id(spec), where) in checked:
            continue
        checked.add((raw, id(spec), where))
        schema = parsed.setdefault(raw, json.loads(raw))
        check_arguments(spec.name, spec.kwargs, schema, where=where, sampled=sampled)


class FanOut(JobHandle[str, dict[str, dict[str, Any]]]):
    """A running fan-out. :meth:`get` (or ``await handle``) returns ``{device: entry}``, the dict
    the chord collected; the rest of its API is :class:`~tasks.producer.handle.JobHandle`'s."""

    def __init__(self, app: Celery, plan: dict[str, JobSpec], result: AsyncResult,
                 connections: Connections | None = None) -> None:
        super().__init__(app, connections)
        self.plan = plan
        self._result_handle = result
        header = result.parent
        self._jobs: dict[str, AsyncResult] = dict(zip(plan, header.results, strict=True)) if header else {}
        self._task_ids = {device: str(res.id) for device, res in self._jobs.items()}

    @property
    def id(self) -> str:
        """The id of the chord's collect task, whose result is the dict."""
        return str(self._result_handle.id)

    @property
    def group_id(self) -> str:
        """The id of the group of device jobs (Celery's ``request.group`` in each job); its first
        8 characters name the fan-out's TensorBoard runs, ``<job>-<group_id[:8]>/<device>``."""
        header = self._result_handle.parent
        return str(header.id) if header is not None else self.id

    @property
    def devices(self) -> list[str]:
        return list(self.plan)

    @property
    def task_ids(self) -> dict[str, str]:
        """``{device: Celery task id}`` of each device's job (for ``AsyncResult``, Flower, logs)."""
        return dict(self._task_ids)

    def jobs(self) -> dict[str, str]:
        return self._task_ids

    def results(self) -> dict[str, AsyncResult]:
        """``{device: AsyncResult}`` of each device's job."""
        return dict(self._jobs)

    def states(self) -> dict[str, str]:
        """Celery state of each device's job (``PENDING``, ``STARTED``, ``PROGRESS``, ``SUCCESS``,
        ``FAILURE``...): one Redis round trip for every device."""
        return self._states(self._read())

    async def astates(self) -> dict[str, str]:
        return self._states(await self._aread())

    def progress(self) -> dict[str, dict[str, Any]]:
        """The latest progress each device's job reported: ``{}`` until it reports, and its
        last report once it has finished (one Redis round trip for every device)."""
        return super().progress()

    def cancel(self) -> None:
        """Cancel the fan-out: a job not started yet never starts, a running one stops at its
        next ``ctx.progress()`` call (cooperative: a job that never reports runs to its end).
        Their entries say ``cancelled``; :meth:`get` still returns every device. A device group
        whose leader has not taken it yet lets the devices it reserved go at once."""
        pending = [self._task_ids[d] for d, state in self.states().items() if state not in READY_STATES]
        if pending:
            revoke(self.app, self.connections.redis, pending)
            logger.info("fan-out %s: cancelled %s", self.id, ", ".join(pending))
            groups = [spec.options.group for key, spec in self.plan.items() if self._task_ids[key] in pending]
            _release_unclaimed(self.connections.redis, [g for g in groups if g is not None])

    def get(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Wait for the chord and return ``{device: entry}``, in the order of the plan.

        Raises:
            FanOutTimeout: ``timeout`` seconds passed first; the fan-out goes on running.
        """
        try:
            # A failed device is an error entry in the collected dict, not an error of the call.
            collected = self._result_handle.get(timeout=timeout, follow_parents=False)
        except CeleryTimeoutError:
            pending = [d for d, state in self.states().items() if state not in READY_STATES]
            raise FanOutTimeout(timeout or 0.0, pending) from None
        return {device: collected[device] for device in self.plan}

    async def _wait(self) -> dict[str, dict[str, Any]]:
        # Only the collect task's state: one channel per fan-out, however many devices.
        listener = self.connections.listener()
        async with listener.subscribe([self.id]) as sub:
            meta = (await self.reader.ametas([self.id]))[self.id]
            while meta is None or meta.get("status") not in READY_STATES:
                message = await sub.next(RECHECK_S)
                if message is None:
                    meta = (await self.reader.ametas([self.id]))[self.id]
                else:
                    meta = self.reader.note(*message)
        return self._collected(meta)

    def _collected(self, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
        result = meta.get("result")
        if meta.get("status") != SUCCESS or not isinstance(result, dict):
            error = result if isinstance(result, dict) else {}
            raise FanOutError(f"fan-out {self.id}: its collect step ended {meta.get('status')}: "
                              f"{error.get('exc_type')}: {error.get('exc_message')}")
        return {device: result[device] for device in self.plan}

    def __repr__(self) -> str:
        return f"<FanOut {self.id} {', '.join(f'{d}:{s.name}' for d, s in self.plan.items())}>"


def fan_out(
    jobs: JobLike | Mapping[str, JobLike],
    devices: str | Sequence[str] = ALL,
    *,
    kwargs: Mapping[str, Any] | None = None,
    options: JobOptions | Mapping[str, Any] | None = None,
    distributed: bool | DistributedOptions | Mapping[str, Any] = False,
    per_slot: bool = False,
    priority: Level | str | None = None,
    user: str | None = None,
    group: int | None = None,
    constraints: Constraints | Mapping[str, Any] | None = None,
    app: Celery | None = None,
    client: Connections | None = None,
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
        distributed: run the job once over all the devices, as the ranks of one
            ``torch.distributed`` job (``True``, or
            :class:`~tasks.core.records.DistributedOptions` as a dict, e.g.
            ``{"max_restarts": 1, "join_timeout_s": 60}``). Each entry's output has its ``rank``.
        per_slot: send each device as many copies of its job as it has slots (``slots`` in its
            worker config), to run at once; the result's keys are then ``<device>/<copy>``
            (``cpu0/0``, ``cpu0/1``) and each entry names the ``slot`` that ran it.
        priority: the jobs' level, ``urgent``, ``normal`` (default) or ``batch``
            (:mod:`tasks.core.priority`): a free device takes the highest level first.
        user: who the jobs are counted to; default the ``user`` setting, else the OS user.
        group: run the job over ``group`` devices of one kind on one host at once, in one job
            process that sees them all (a *device group*: ``ctx.devices``, the union of their
            cores, every GPU visible); as many groups as ``devices`` make, each keyed by its
            devices joined with ``+`` (``cpu0+cpu1``). A mapping's key names a group the same
            way: ``{"cpu0+cpu1": job}``. See the device groups guide.
        constraints: what a device must be to run the job (:class:`~tasks.core.placement.Constraints`
            or a dict: ``{"min_memory_gib": 40, "labels": {"nvlink": True}}``): of a kind or
            ``"all"``, the devices that meet them and are in service; a device named outright (in
            ``devices`` or a mapping) must meet them.
        app: the Celery app to send through; default ``client``'s, else ``tasks.app``.
        client: the :class:`~tasks.producer.client.FleetClient` (or
            :class:`~tasks.producer.connections.Connections`) whose Redis connections the handle
            uses; default the app's own.

    Raises:
        DeviceUnavailable: a requested device has no live worker (nothing is sent).
        GroupUnavailable: no live host has ``group`` devices of one kind among ``devices``, or
            a named group's devices are not of one kind on one host (nothing is sent).
        PlacementUnavailable: no device of ``devices`` in service meets ``constraints``, or a
            device named outright does not (nothing is sent).
        ConfigError: a job spec is malformed, ``priority`` or ``user`` is invalid, or a
            constraint is unknown or bad.
        UnknownJob: a device's worker does not run the job (nothing is sent).
        InvalidJobArguments: the job's params refuse the kwargs (nothing is sent).
    """
    app = app or (client.app if client is not None else default_app())
    client = client if client is not None and client.app is app else Connections.of(app)
    if isinstance(jobs, Mapping) and not _looks_like_spec(jobs):
        if not jobs:
            raise ConfigError("fan_out({}) names no device")
        kinds = [n for n in jobs if n in _KIND_NAMES]
        if kinds:
            raise ConfigError(
                f"fan_out mapping keys must be device names, got {kinds}; use "
                "fan_out(job, devices=...) to run one job on every device of a kind"
            )
        if group is not None:
            raise ConfigError("group= goes with one job over devices=...; in a mapping, name a group "
                              "by its devices: {'cpu0+cpu1': job}")
        plan = {device: constrained(prioritized(job, priority, user), constraints) for device, job in jobs.items()}
        live = live_devices(client=client)
        # raises DeviceUnavailable before anything is sent
        serving_devices(client.redis, [device for key in jobs for device in key_devices(key)], live)
        _check_named(plan, live, client.redis)
        whys = {key: f"{key}: named by the caller" for key in plan if GROUP_SEPARATOR in key}
        for key in whys:
            check_named_group(key_devices(key), live)
    else:
        spec = constrained(prioritized(JobSpec.of(jobs, kwargs, options), priority, user),  # type: ignore[arg-type]
                           constraints)
        live = live_devices(client=client)
        chosen = serving_placed(client.redis, devices, live, spec)
        whys = {}
        if group is not None:
            whys = {choice.key: choice.why for choice in placed_groups(chosen, live, check_group_size(group), spec,
                                                                       devices)}
            chosen = list(whys)
        plan = {key: spec for key in chosen}
    check_jobs({device: spec for key, spec in plan.items() for device in key_devices(key)}, live)
    check_kwargs(client.redis, [(device, spec, "") for key, spec in plan.items() for device in key_devices(key)])
    grouped = [key for key in plan if GROUP_SEPARATOR in key]
    if grouped:
        if distributed is not False or per_slot:
            raise ConfigError("a device group is one job in one process over its devices: it goes with "
                              "neither distributed nor per_slot")
        return _send_groups(app, plan, whys, client)
    if distributed is not False:
        if per_slot:
            raise ConfigError("per_slot=True cannot be used with distributed: a gang has one rank per device")
        return _send_gang(app, plan, live, distributed, client)
    if per_slot:
        plan = {slot_key(device, copy): spec for device, spec in plan.items()
                for copy in range(live[device].slot_count)}
    return FanOut(app, plan, _send(app, plan), client)


def _check_named(plan: Mapping[str, JobSpec], live: Mapping[str, WorkerRecord], client: redis.Redis) -> None:
    """Each device a mapping names meets its job's constraints.

    Raises:
        PlacementUnavailable: a named device does not (nothing is sent).
    """
    if all(spec.options.constraints is None for spec in plan.values()):
        return
    out = out_of_service(client, list(live))
    for key, spec in plan.items():
        devices = key_devices(key)
        place(devices, live, spec.options.constraints, out, named=devices)


def _send(app: Celery, plan: Mapping[str, JobSpec]) -> AsyncResult:
    # A group's message goes to its leader, its first device.
    header = [spec.signature(app, device_queue(key_devices(key_device(key))[0])) for key, spec in plan.items()]
    # The collect step at the jobs' highest level: an urgent fan-out is not collected behind
    # normal work.
    level = min((spec.level for spec in plan.values()), key=lambda lvl: lvl.rank, default=Level.NORMAL)
    owned = {"task_id": owned_task_id(sender_of(app))} if sends_as_user(app) else {}  # its result: the user's
    body = app.signature(COLLECT_TASK, kwargs={"devices": list(plan)}, queue=level_queue(QueueName.FLEET.value, level),
                         **owned)
    result = chord(header, app=app)(body)
    logger.debug("fan-out %s sent to %s", result.id, ", ".join(plan))
    return result


def gang_spec(plan: Mapping[str, JobSpec], live: Mapping[str, WorkerRecord],
              distributed: bool | DistributedOptions | Mapping[str, Any], seq: int) -> GangSpec:
    """The gang of a distributed fan-out: one job over the plan's devices, in order.

    Raises:
        ConfigError: the plan has several jobs, an option is invalid, or nccl was asked with a
            CPU device among the ranks.
    """
    if distributed is True:
        opts = DistributedOptions()
    elif isinstance(distributed, DistributedOptions):
        opts = distributed
    elif isinstance(distributed, Mapping):
        try:
            opts = DistributedOptions.model_validate(dict(distributed))
        except ValidationError as exc:
            raise ConfigError(f"distributed={dict(distributed)!r}: {describe_validation_error(exc)}") from None
    else:
        raise ConfigError(f"distributed={distributed!r}: give True or a dict of DistributedOptions")
    specs = {(spec.name, json.dumps(spec.kwargs, sort_keys=True)) for spec in plan.values()}
    if len(specs) != 1:
        raise ConfigError("a distributed job is one job over several devices; got different jobs "
                          f"per device ({', '.join(sorted({name for name, _ in specs}))})")
    spec = next(iter(plan.values()))
    if spec.options.fallback is not None:
        raise ConfigError(f"fallback={spec.options.fallback!r} cannot be used with distributed: a "
                          "rank cannot move to another device without its gang")
    cpu = [device for device in plan if live[device].kind != DeviceKind.GPU.value]
    backend = opts.backend
    if backend is DistBackend.AUTO:
        backend = DistBackend.GLOO if cpu else DistBackend.NCCL
    elif backend is DistBackend.NCCL and cpu:
        raise ConfigError(f"backend 'nccl' needs a GPU on every rank; {', '.join(cpu)} "
                          f"{'is a CPU device' if len(cpu) == 1 else 'are CPU devices'}: use 'gloo' or 'auto'")
    return GangSpec(id=uuid.uuid4().hex, devices=list(plan), seq=seq,
                    backend="nccl" if backend is DistBackend.NCCL else "gloo",
                    max_restarts=opts.max_restarts, join_timeout_s=opts.join_timeout_s,
                    collective_timeout_s=opts.collective_timeout_s)


def _send_gang(app: Celery, plan: dict[str, JobSpec], live: Mapping[str, WorkerRecord],
               distributed: bool | DistributedOptions | Mapping[str, Any], connections: Connections) -> FanOut:
    client = connections.redis
    gang_spec(plan, live, distributed, seq=0)  # refuse bad options before taking a number or the lock
    # Holding the lock while the ranks are published puts one gang's ranks before the next
    # gang's on every device's queue, so two gangs sent at once do not each take one device
    # and wait for the other's. The workers' wait-die rule covers what order cannot.
    with client.lock(keys.GANG_SEND_LOCK, timeout=GANG_SEND_WAIT_S, blocking_timeout=GANG_SEND_WAIT_S):
        gang = gang_spec(plan, live, distributed, seq=int(client.incr(keys.CLAIM_SEQ)))
        ranks = {device: spec.model_copy(update={"options": spec.options.model_copy(update={"gang": gang})})
                 for device, spec in plan.items()}
        result = _send(app, ranks)
    logger.info("distributed %s %s: %d ranks (%s) on %s", next(iter(plan.values())).name, gang.id,
                gang.world_size, gang.backend, ", ".join(gang.devices))
    return FanOut(app, ranks, result, connections)


def _send_groups(app: Celery, plan: dict[str, JobSpec], whys: Mapping[str, str], connections: Connections) -> FanOut:
    """Send a fan-out with device groups (:func:`group_job` each); if sending fails, the devices
    reserved for its groups are let go."""
    sent: dict[str, JobSpec] = {}
    try:
        for key, spec in plan.items():
            sent[key] = group_job(spec, GroupChoice(key_devices(key), whys.get(key, key)), connections, app) \
                if GROUP_SEPARATOR in key else spec
        result = _send(app, sent)
    except BaseException:
        _release_unclaimed(connections.redis, [spec.options.group for spec in sent.values() if spec.options.group])
        raise
    logger.info("fan-out %s: groups %s", result.id, ", ".join(k for k in sent if GROUP_SEPARATOR in k))
    return FanOut(app, sent, result, connections)


def group_job(spec: JobSpec, choice: GroupChoice, connections: Connections, app: Celery) -> JobSpec:
    """``spec`` as the job of the device group ``choice``, to send to its leader's queue: its
    options carry a fresh :class:`~tasks.core.records.GroupSpec` (its age from
    ``keys.CLAIM_SEQ``); why the group got its devices is stored for ``devicefleet status``; and
    the group's devices other than its leader are reserved for it
    (:func:`~tasks.core.group_reservation.reserve_at_send`, for
    :data:`~tasks.core.defaults.GROUP_CLAIM_TTL_S` until its leader claims them): a single job
    sent to them after it waits for it.

    Raises:
        ConfigError: the job is a gang's rank or falls back to the cpu.
    """
    if spec.options.gang is not None or spec.options.fallback is not None:
        raise ConfigError(f"group {choice.key}: a device group's job cannot be a gang's rank or fall back to the cpu")
    group_id = uuid.uuid4().hex
    attempt = f"{group_id}.{uuid.uuid4().hex[:8]}"
    pipe = connections.redis.pipeline(transaction=False)
    pipe.set(keys.group_choice(group_id), choice.why, ex=max(60, int(app.backend.expires or RESULT_EXPIRES_S)))
    reserve_at_send(pipe, group_id, choice.devices, attempt, GROUP_CLAIM_TTL_S, spec.options.priority)
    seq = int(pipe.execute()[-1])
    group = GroupSpec(id=group_id, devices=list(choice.devices), seq=seq, reservation=attempt)
    return spec.model_copy(update={"options": spec.options.model_copy(update={"group": group})})


def _release_unclaimed(client: redis.Redis, groups: Sequence[GroupSpec]) -> None:
    """Let go the devices reserved at send time for ``groups`` whose leaders have not taken them
    (a claimed group is its leader's to release)."""
    for group in groups:
        if group.reservation is None:
            continue
        try:
            if release_unclaimed(client, group.devices, group.reservation):
                logger.info("group %s: let its devices go before its leader took it", group.name)
        except redis.RedisError as exc:  # its reservation expires by itself
            logger.warning("group %s: could not let its reservation go: %s", group.name, exc)


def _looks_like_spec(mapping: Mapping[str, Any]) -> bool:
    return set(mapping) <= {"name", "kwargs", "options"} and "name" in mapping
