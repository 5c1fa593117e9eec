"""Sweeps: many trials of one job over a few devices, every device busy until the last trial.

::

    import tasks
    handle = tasks.sweep("train", tasks.grid({"lr": [0.1, 0.03, 0.01], "seed": [0, 1]}), name="lr")
    entries = handle.get(timeout=3600)   # one entry per trial, in trial order
    entries[0]   # {"device": "cpu1", "status": "ok", "output": {...}, ..., "trial": 0, "kwargs": {...}}

The trials go to one queue that every chosen device consumes (:mod:`tasks.producer.trials`):
a device takes the next trial the moment it is free, so a fast GPU runs more of them than a CPU
worker and no device waits for the slowest of a wave. Each trial runs once: trials are Celery
tasks with fixed ids under the workers' leases, as fan-outs are.

A named sweep can be resumed: when its producer dies, the same call with the same name (and the
same job and trials; another set is refused with :class:`~tasks.core.errors.SweepConflict`)
adopts what was sent and still runs, sends what was not, and returns every trial once.

With ``group=k`` each trial runs over a device group of ``k`` devices of one host, in one job
process (see :mod:`tasks.producer.trials`): ``tasks.sweep("train", trials, "cpu", group=2)``.

``handle.cancel()``: queued trials never start, running ones stop at their next
``ctx.progress()``; their entries say ``cancelled``.

Sent with a user's credentials (:mod:`tasks.core.users`), a sweep is that user's: its id is its
name with the user's mark (``lr.u-616c696365``: :func:`~tasks.core.users.owned_id`), so that its
record, its queue and its trials' results are keys only they write or read, and the same name
resumes their sweep, never another user's.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery

from ..core import keys
from ..core.commands import COMMAND_JOB, command_params
from ..core.defaults import RESULT_EXPIRES_S
from ..core.errors import ConfigError, InvalidJobArguments, SweepConflict
from ..core.placement import Constraints
from ..core.priority import Level
from ..core.records import SweepRecord, parse_pack, stored
from ..core.users import owned_id
from .connections import Connections, default_app
from .fanout import (
    ALL,
    JobLike,
    JobSpec,
    check_jobs,
    check_kwargs,
    constrained,
    credentials_of,
    live_devices,
    prioritized,
    serving_placed,
)
from .handle import JobHandle, Summary, summarize
from .packing import Packing, packed_spec, plan_packing
from .trials import TrialQueue, entry_of, queue_for, trial_groups

logger = logging.getLogger(__name__)

def grid(axes: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of ``axes``' values, as trials: ``grid({"lr": [1, 2], "seed": [0, 1]})``
    is four kwargs dicts, the last axis changing fastest.

    Raises:
        ConfigError: an axis is not a non-empty list.
    """
    if not isinstance(axes, Mapping) or not axes:
        raise ConfigError(f"grid({axes!r}): give a dict of parameter name -> list of values")
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ConfigError(f"grid axis {name!r} is {values!r}: give a non-empty list of values")
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(axes[n] for n in names))]


#: A sweep's counts: the handles' :class:`~tasks.producer.handle.Summary` (the old name, kept).
SweepSummary = Summary


class Sweep(JobHandle[int, list[dict[str, Any]]]):
    """A running sweep; :meth:`get` (or ``await handle``) returns one entry per trial, in trial
    order. The rest of its API is :class:`~tasks.producer.handle.JobHandle`'s, keyed by trial
    number; ``states()`` is a list in trial order."""

    progress_of_every_job = False

    def __init__(self, app: Celery, record: SweepRecord, specs: list[JobSpec], queue: TrialQueue,
                 sent: set[int], max_concurrent: int | None, packing: Packing | None = None) -> None:
        super().__init__(app, queue.connections, queue.reader)
        #: What ``pack=`` did: ``packing.reason`` is ``"packed 8"``, or why the trials run unpacked.
        self.packing = packing or Packing(None, "unpacked")
        self.record = record
        self.specs = specs
        self.queue = queue
        self.max_concurrent = max_concurrent
        self.task_ids = [queue.task_id(i) for i in range(len(specs))]
        self._jobs = dict(enumerate(self.task_ids))
        self._sent = sent
        self._cancelled = record.cancelled
        self._detached = False
        # An awaiting reader advances the sweep from a thread; a blocking one from its own.
        self._advancing = threading.Lock()

    @property
    def id(self) -> str:
        return self.record.sweep_id

    @property
    def devices(self) -> list[str]:
        return self.queue.devices

    def jobs(self) -> dict[int, str]:
        return self._jobs

    def __len__(self) -> int:
        return len(self.specs)

    # -- feeding -----------------------------------------------------------------------------

    def _open(self, metas: Mapping[str, dict[str, Any] | None]) -> int:
        return sum(1 for i in self._sent if entry_of(metas.get(self.task_ids[i])) is None)

    def feed(self, metas: Mapping[str, dict[str, Any] | None] | None = None) -> int:
        """Send the trials not sent yet, at most ``max_concurrent`` unfinished at a time;
        returns how many were sent. Called by every poll of the handle."""
        if self._cancelled or len(self._sent) == len(self.specs):
            return 0
        todo = [i for i in range(len(self.specs)) if i not in self._sent]
        if self.max_concurrent is not None:
            metas = metas if metas is not None else self.queue.metas(self.task_ids)
            todo = todo[:max(0, self.max_concurrent - self._open(metas))]
        if not todo:
            return 0
        sent = self.queue.send((i, self.specs[i]) for i in todo)
        pipe = self.connections.redis.pipeline()
        pipe.sadd(keys.sweep_sent(self.id), *sent)
        pipe.expire(keys.sweep_sent(self.id), _expires(self.app))  # with the record and the results
        pipe.execute()
        self._sent.update(sent)
        return len(sent)

    def _advance(self, metas: Mapping[str, dict[str, Any] | None]) -> bool:
        """Send more trials if ``max_concurrent`` allows, ask restarted workers again to consume
        the sweep's queue, and let it go once every trial has finished."""
        with self._advancing:
            fed = self.feed(metas) > 0
            self.queue.refresh()
            if not fed and not self._detached and self._all_final(metas):
                self.queue.detach()
                self._detached = True
            return fed

    def _advance_due(self, metas: Mapping[str, dict[str, Any] | None]) -> bool:
        unsent = not self._cancelled and len(self._sent) < len(self.specs)
        room = self.max_concurrent is None or self._open(metas) < self.max_concurrent
        return (unsent and room) or self.queue.refresh_due() or (not self._detached and self._all_final(metas))

    # -- reading -----------------------------------------------------------------------------

    def poll(self) -> list[dict[str, Any] | None]:
        """Read every trial's stored meta (one MGET for those not finished), send more trials
        if ``max_concurrent`` allows, and return the metas in trial order."""
        by_id = self._read()
        return [by_id[tid] for tid in self.task_ids]

    def states(self) -> list[str]:
        """The Celery state of each trial, in trial order (``PENDING`` while queued)."""
        return self._states_view(self._states(self._read()))

    async def astates(self) -> list[str]:
        return self._states_view(self._states(await self._aread()))

    def _states_view(self, states: dict[int, str]) -> list[str]:
        return [states[i] for i in range(len(self.task_ids))]

    def _device_of(self, meta: dict[str, Any] | None) -> str | None:
        return self.queue.device_of(meta)

    def _name(self, key: int) -> str:
        return f"trial {key}"

    def summary(self, metas: list[dict[str, Any] | None] | None = None) -> Summary:
        """Done, failed, cancelled, running and queued counts, and per device."""
        if metas is None:
            return super().summary()
        return summarize(metas, self.devices, self.queue.device_of)

    def entries(self, metas: list[dict[str, Any] | None] | None = None) -> list[dict[str, Any] | None]:
        """Each trial's entry (the fan-out entry's keys plus ``trial`` and ``kwargs``), or None
        while it has not finished."""
        metas = metas if metas is not None else self.poll()
        out: list[dict[str, Any] | None] = []
        for i, meta in enumerate(metas):
            entry = entry_of(meta)
            out.append(None if entry is None else {**entry, "trial": i, "kwargs": dict(self.specs[i].kwargs)})
        return out

    def _result(self, metas: Mapping[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
        return [e for e in self.entries([metas.get(tid) for tid in self.task_ids]) if e is not None]

    def get(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for every trial and return their entries, in trial order.

        A trial that failed is an entry with ``status`` error: the sweep itself does not fail.

        Raises:
            FanOutTimeout: ``timeout`` seconds passed first; the sweep goes on running.
        """
        return self._poll_until_final(timeout)

    # -- cancelling --------------------------------------------------------------------------

    def cancel(self) -> None:
        """Queued trials never start; running ones stop at their next ``ctx.progress()``;
        their entries say ``cancelled``. Finished trials keep their entries."""
        self._cancelled = True
        self.record = self.record.model_copy(update={"cancelled": True})
        _save(self.app, self.record, self.connections)
        self.queue.cancel([self.task_ids[i] for i in sorted(self._sent)], reason=f"sweep {self.id} cancelled")
        # Never sent: stored as cancelled so get() returns them.
        self.queue.store_revoked([self.task_ids[i] for i in range(len(self.specs)) if i not in self._sent],
                                 reason=f"sweep {self.id} cancelled")
        self.queue.detach()
        self._detached = True

    def __repr__(self) -> str:
        return f"<Sweep {self.id} {self.record.job} x{len(self.specs)} on {', '.join(self.devices)}>"


def trial_specs(job: JobLike, trials: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any] | None = None,
                ) -> list[JobSpec]:
    """One :class:`JobSpec` per trial: the job's kwargs updated with the trial's.

    Raises:
        ConfigError: ``trials`` is not a list of dicts; the message names the first bad trial.
    """
    if isinstance(trials, (str, bytes, Mapping)) or not isinstance(trials, Sequence):
        raise ConfigError(f"trials must be a list of kwargs dicts, got {type(trials).__name__}")
    base = JobSpec.sharing(job, kwargs)
    specs = []
    for i, trial in enumerate(trials):
        if not isinstance(trial, Mapping):
            raise ConfigError(f"trial {i} is {trial!r}, not a dict of the job's kwargs (nothing was sent)")
        try:
            spec = JobSpec.of(base, {**base.kwargs, **trial})
            if spec.name == COMMAND_JOB:  # every trial fills the command's placeholders
                command_params(spec.kwargs).formatted_argv()
        except (ConfigError, InvalidJobArguments) as exc:
            raise ConfigError(f"trial {i}: {exc} (nothing was sent)") from None
        specs.append(spec)
    return specs


def digest(specs: Sequence[JobSpec]) -> str:
    """sha256 of the specs, in order: what a resumed sweep must match."""
    h = hashlib.sha256()
    for spec in specs:
        h.update(spec.model_dump_json().encode())
        h.update(b"\n")
    return h.hexdigest()


def _expires(app: Celery) -> int:
    """Seconds a sweep's keys live: as long as its trials' results (the backend's ``expires``)."""
    return max(60, int(app.backend.expires or RESULT_EXPIRES_S))


def _save(app: Celery, record: SweepRecord, connections: Connections) -> None:
    """Store the record; it expires with the trials' results."""
    connections.redis.set(keys.sweep(record.sweep_id), record.to_json(), ex=_expires(app))


def sweep(
    job: JobLike,
    trials: Sequence[Mapping[str, Any]],
    devices: str | Sequence[str] = ALL,
    *,
    name: str | None = None,
    max_concurrent: int | None = None,
    kwargs: Mapping[str, Any] | None = None,
    priority: Level | str | None = None,
    user: str | None = None,
    group: int | None = None,
    pack: int | str | None = None,
    constraints: Constraints | Mapping[str, Any] | None = None,
    app: Celery | None = None,
    client: Connections | None = None,
) -> Sweep:
    """Run ``job`` once per trial over ``devices``; each device takes the next trial when free.

    Args:
        job: the job (a name, ``(name, kwargs)`` or :class:`JobSpec`).
        trials: a list of kwargs dicts, one per trial (see :func:`grid`); each updates the
            job's own kwargs.
        devices: ``"all"``, ``"cpu"``, ``"gpu"``, device names, or a comma list of those.
        name: names the sweep, so that running the same call again resumes it.
        max_concurrent: at most this many trials sent and unfinished at a time (the handle
            sends more as it is polled); default: every trial is queued at once.
        kwargs: kwargs every trial shares.
        priority: the trials' level (``urgent``, ``normal``, ``batch``); a resumed sweep keeps
            the level and user it was sent with.
        user: who the trials are counted to; default the ``user`` setting, else the OS user.
        group: run each trial over ``group`` devices of one kind on one host at once, in one
            job process that sees them all (a device group, as ``fan_out(..., group=k)``): the
            groups ``devices`` make, each running one trial at a time (``max_concurrent``
            defaults to their number); each entry's ``device`` names its group (``cpu0+cpu1``).
        pack: train up to this many trials as one packed (vmapped) model in one job process,
            or ``"auto"``: as many as fit the slot's memory budget (:mod:`tasks.producer.packing`).
            The job must opt in; trials that differ in a param their model's shape hangs on run
            unpacked, and ``handle.packing.reason`` says why. A packed sweep has its own queue.
        constraints: what a device must be to run a trial (:mod:`tasks.core.placement`): the
            trials go to a queue only the devices of ``devices`` that meet them consume (a
            device named outright must meet them).
        app: the Celery app to send through; default ``client``'s, else ``tasks.app``.
        client: the :class:`~tasks.producer.client.FleetClient` whose connections the handle
            uses; default the app's own.

    Raises:
        ConfigError: a trial is not a dict, an argument is out of range, ``priority`` or
            ``user`` is invalid, or ``pack`` is not a count >= 1 or ``"auto"``, or asks a job or a
            command that does not pack.
        DeviceUnavailable: a requested device has no live worker (nothing is sent).
        PlacementUnavailable: no device of ``devices`` in service meets ``constraints``, or a
            device named outright does not (nothing is sent).
        GroupUnavailable: no live host has ``group`` devices of one kind among ``devices``
            (nothing is sent).
        UnknownJob: a device's worker does not run the job (nothing is sent).
        InvalidJobArguments: the job's params refuse a trial's kwargs (nothing is sent).
        SweepConflict: a sweep of that name exists with another job or other trials.
    """
    app = app or (client.app if client is not None else default_app())
    connections = client if client is not None and client.app is app else Connections.of(app)
    specs = trial_specs(constrained(prioritized(job, priority, user), constraints), trials, kwargs)
    parse_pack(pack)  # a bad value is refused before the registry is read
    if max_concurrent is not None and max_concurrent < 1:
        raise ConfigError(f"max_concurrent={max_concurrent!r}: give at least 1, or None for all at once")
    if name is not None and not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"sweep name {name!r}: use letters, digits, '-', '_' and '.'")
    live = live_devices(client=connections)
    base = specs[0] if specs else constrained(JobSpec.of(job), constraints)
    chosen = serving_placed(connections.redis, devices, live, base)
    groups = trial_groups(chosen, live, group, base, devices)
    if groups is not None:
        chosen = [device for choice in groups for device in choice.devices]
        max_concurrent = max_concurrent if max_concurrent is not None else len(groups)
    if specs:
        check_jobs({device: specs[0] for device in chosen}, live)
        check_kwargs(connections.redis, [(device, spec, f"trial {i}") for i, spec in enumerate(specs)
                                         for device in chosen])
    packing = plan_packing(pack, specs, chosen, live, group)
    specs = [packed_spec(spec, packing) for spec in specs]
    # A user's sweep: its keys, queue and trial ids are theirs (tasks.core.users.owned_id).
    credentials = credentials_of(app)
    sweep_id = owned_id(name or uuid.uuid4().hex, credentials.user if credentials is not None else None)
    # A packed sweep's queue holds only its trials: the worker that takes one pulls its siblings.
    queue_name = queue_for(sweep_id, chosen, live, own=packing.packed or base.options.constraints is not None)
    record = SweepRecord(sweep_id=sweep_id, job=specs[0].name if specs else JobSpec.of(job).name,
                         digest=digest(specs), trials=len(specs), devices=chosen,
                         queue=queue_name, created_at=time.time())
    registry = connections.redis
    sent: set[int] = set()
    existing = registry.get(keys.sweep(sweep_id)) if name else None
    if existing:
        old = stored(SweepRecord, existing)
        if old.digest != record.digest:
            raise SweepConflict(
                f"sweep {name!r} exists with {old.trials} trials of {old.job!r} and other kwargs; "
                f"resume it with the same job and trials, or give another name (nothing was sent)"
            )
        record = old.model_copy(update={"devices": chosen})  # its queue holds what was sent
        sent = {int(i) for i in registry.smembers(keys.sweep_sent(sweep_id))}
        logger.info("sweep %s: resuming, %d of %d trials sent before", sweep_id, len(sent), len(specs))
    _save(app, record, connections)
    level = specs[0].level if specs else prioritized(job, priority).level
    queue = TrialQueue(app, sweep_id, chosen, live, queue=record.queue, connections=connections, level=level,
                       groups=groups)
    if not record.cancelled:
        queue.attach()
    handle = Sweep(app, record, specs, queue, sent, max_concurrent, packing)
    handle.feed()
    logger.debug("sweep %s: %d trials of %s on %s", sweep_id, len(specs), record.job, ", ".join(chosen))
    return handle
