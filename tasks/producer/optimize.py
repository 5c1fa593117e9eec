"""Optuna studies over the fleet: Optuna picks each trial's parameters, a free device runs it.

::

    import tasks
    study = tasks.optimize("train", {"lr": {"low": 1e-3, "high": 0.3, "log": True},
                                     "model": ["mlp", "cnn"]},
                           n_trials=40, objective="accuracy", pruner="median", name="lr-model")
    study.best_trial.params, study.best_value

The study is a real :class:`optuna.Study`, kept in the fleet's Redis by Optuna's own journal
storage (``JournalRedisBackend`` on the fleet's client, :mod:`tasks.producer.journal`, keys under
:data:`tasks.core.keys.OPTUNA_PREFIX`; a user's, with their credentials, under their own prefix:
:func:`tasks.core.users.optuna_prefix`, and the study's queue and trial ids are theirs), so
``optuna.load_study(study_name=..., storage=tasks.producer.optimize.journal_storage(app))``,
``study.trials_dataframe()`` and optuna-dashboard read it. This producer asks Optuna for a
trial's parameters, runs the trial as a job on the study's queue (:mod:`tasks.producer.trials`:
the next free device takes it), and tells Optuna the ``objective`` field of the job's output.

Pruning: a job reports intermediate values with ``ctx.progress(step=..., value=...)``; each new
step is reported to the trial (``trial.report``) and, when the pruner says so, the trial's job is
revoked. It stops at its next ``ctx.progress()`` (its device's memory is released before the
device takes the next trial) and the trial ends ``PRUNED``.

A running study is a handle (:func:`start_study` returns a :class:`StudyHandle`, a
:class:`~tasks.producer.handle.JobHandle` keyed by trial number): ``states()``, ``summary()``,
``cancel()``, ``get()`` and, from async code, ``await handle``, ``watch()``, ``asummary()``,
``acancel()``. The study advances as its handle is read: awaited, each trial's state heard on
Redis pub/sub wakes it (nothing polls at an interval); ``get()`` reads with a 2-100 ms backoff.
:func:`optimize` is ``start_study(...).get()``.

Resume: the same call with the same ``name`` loads the study, adopts the trials still running
(sent again under the same task id: a copy of a trial that runs or ran is dropped by the
worker's lease) and asks for trials until ``n_trials`` have finished in all.

Packed (``pack=K`` or ``"auto"``, as :func:`tasks.sweep`'s): the study's trials go to a queue of
its own, and a worker that takes one trains up to K of them as one vmapped model
(:mod:`tasks.producer.packing`); each trial is still its own message, lease and entry, told to
Optuna when it ends. A packed study asks Optuna for K trials per slot at once (the sampler sees
fewer finished trials before it asks: packing trades its feedback for throughput). A pruned
trial's job is revoked as alone: its pack masks it out and trains on.

Optuna is the ``sweep`` extra: ``pip install 'devicefleet[sweep]'``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery

from ..core.app import redis_url_of
from ..core.commands import COMMAND_JOB
from ..core.defaults import PACK_AUTO_MAX
from ..core.errors import ConfigError, FanOutTimeout, MissingExtra, SweepConflict
from ..core.job import PROGRESS_STATE
from ..core.placement import Constraints
from ..core.priority import Level
from ..core.queues import sweep_queue
from ..core.records import Entry, EntryStatus, parse_pack
from ..core.sentinel import Replication
from ..core.transport import REPLICATION_OPTION
from ..core.users import optuna_prefix, owned_id
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
    revoke,
    serving_placed,
)
from .handle import JobHandle, Summary
from .packing import Packing, packed_spec, plan_study_packing
from .reader import Meta, state_of
from .trials import TrialQueue, entry_of, trial_groups

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

#: The study's user attribute naming its job: a name reused for another job is refused.
JOB_ATTR = "devicefleet_job"
#: Pruners by the names the CLI takes.
PRUNERS = ("median", "asha", "hyperband", "none")


def require_optuna() -> Any:
    """The ``optuna`` module.

    Raises:
        MissingExtra: Optuna is not installed.
    """
    try:
        import optuna
    except ImportError:
        raise MissingExtra(
            "tasks.optimize needs Optuna, which is not installed: pip install 'devicefleet[sweep]'"
        ) from None
    return optuna


def journal_storage(app: Celery) -> optuna.storages.JournalStorage:
    """Optuna's journal storage in the fleet's Redis (what ``optuna.load_study`` takes): with a
    user's credentials, that user's own journal (:func:`tasks.core.users.optuna_prefix`)."""
    optuna = require_optuna()
    from .journal import FleetJournalBackend

    with warnings.catch_warnings():  # the Redis journal backend is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        credentials = credentials_of(app)
        prefix = optuna_prefix(credentials.user if credentials is not None else None)
        backend = FleetJournalBackend(redis_url_of(app), prefix=prefix,
                                      replication=Replication.of(app.conf.get(REPLICATION_OPTION)))
    return optuna.storages.JournalStorage(backend)


def parse_space(space: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: optuna distribution}`` from a space given as distributions or as JSON.

    Each value may be an Optuna distribution; its JSON form
    (``{"name": "FloatDistribution", "attributes": {...}}``); a list (categorical); or
    ``{"low": .., "high": .., "log"?: bool, "step"?: ..}`` (integers when low and high are).

    Raises:
        ConfigError: Optuna refuses a distribution; the message names the parameter.
    """
    optuna = require_optuna()
    dists = optuna.distributions
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(f"space {space!r}: give a dict of parameter name -> distribution")
    out: dict[str, Any] = {}
    for name, value in space.items():
        try:
            if isinstance(value, dists.BaseDistribution):
                out[name] = value
            elif isinstance(value, (list, tuple)):
                out[name] = dists.CategoricalDistribution(list(value))
            elif isinstance(value, Mapping) and "attributes" in value:
                out[name] = dists.json_to_distribution(json.dumps(dict(value)))
            elif isinstance(value, Mapping) and {"low", "high"} <= set(value):
                extra = set(value) - {"low", "high", "log", "step"}
                if extra:
                    raise ValueError(f"unknown keys {sorted(extra)}; use low, high, log, step")
                ints = all(isinstance(value[k], int) and not isinstance(value[k], bool)
                           for k in ("low", "high"))
                kind = dists.IntDistribution if ints else dists.FloatDistribution
                out[name] = kind(value["low"], value["high"], log=bool(value.get("log", False)),
                                 step=value.get("step", 1 if ints else None))
            else:
                raise ValueError("give a list (categorical), {low, high[, log, step]} or Optuna's JSON form")
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"space[{name!r}] = {value!r}: {exc}") from None
    return out


def make_pruner(pruner: Any) -> Any:
    """An Optuna pruner from one, or from a name of :data:`PRUNERS` (None: no pruning).

    Raises:
        ConfigError: an unknown name.
    """
    optuna = require_optuna()
    if pruner is None or pruner == "none":
        return optuna.pruners.NopPruner()
    if isinstance(pruner, optuna.pruners.BasePruner):
        return pruner
    makers = {"median": optuna.pruners.MedianPruner, "asha": optuna.pruners.SuccessiveHalvingPruner,
              "hyperband": optuna.pruners.HyperbandPruner}
    if pruner not in makers:
        raise ConfigError(f"pruner {pruner!r}: use one of {', '.join(PRUNERS)}, or an optuna pruner")
    return makers[pruner]()


@dataclass
class StudyProgress:
    """What a live view shows of a running study."""

    name: str
    n_trials: int
    finished: int = 0
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    #: ``{trial number: device}`` of the trials running now (None: queued).
    running: dict[int, str | None] = field(default_factory=dict)
    #: ``{device: trials finished there}``.
    devices: dict[str, int] = field(default_factory=dict)
    best_value: float | None = None
    best_params: dict[str, Any] | None = None


@dataclass
class _InFlight:
    trial: Any  # optuna.Trial
    task_id: str
    reported: set[int] = field(default_factory=set)
    pruning: bool = False


def start_study(
    job: JobLike,
    space: Mapping[str, Any],
    n_trials: int,
    objective: str,
    *,
    direction: str = "maximize",
    devices: str | Sequence[str] = ALL,
    pruner: Any = None,
    sampler: Any = None,
    name: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    max_concurrent: int | None = None,
    on_update: Callable[[StudyProgress], None] | None = None,
    priority: Level | str | None = None,
    user: str | None = None,
    group: int | None = None,
    pack: int | str | None = None,
    constraints: Constraints | Mapping[str, Any] | None = None,
    app: Celery | None = None,
    client: Connections | None = None,
) -> StudyHandle:
    """Start an Optuna study of ``n_trials`` trials of ``job`` over ``devices``: its first trials
    are sent when this returns. The :class:`StudyHandle` runs the study as it is read (``get()``,
    ``await``, ``watch()``, ``states()``...): each read tells Optuna what finished, prunes, and asks
    for the next trials.

    Args:
        job: the job; ``kwargs`` are the kwargs every trial shares.
        space: ``{parameter: distribution}`` (see :func:`parse_space`); each trial's parameters
            are passed to the job as kwargs.
        n_trials: trials the study has when it ends (a resumed study counts those it had).
        objective: the field of the job's output that is the trial's value.
        direction: ``maximize`` or ``minimize``.
        pruner: an Optuna pruner or ``median``, ``asha``, ``hyperband``; None: no pruning.
        sampler: an Optuna sampler (default Optuna's, TPE).
        name: the study's name in the fleet's Redis; the same name resumes it.
        max_concurrent: trials running at once (default: one per slot of each device).
        on_update: called with a :class:`StudyProgress` after every read that advanced the study
            (for a live view; from a thread when the handle is awaited).
        priority: the trials' level (``urgent``, ``normal``, ``batch``).
        user: who the trials are counted to; default the ``user`` setting, else the OS user.
        group: run each trial over ``group`` devices of one kind on one host at once, in one
            job process (a device group, as :func:`tasks.sweep`'s ``group``): one trial per
            group at a time by default; a trial's ``device`` user attribute names its group.
        pack: train up to this many trials as one packed (vmapped) model in one job process, or
            ``"auto"`` (as :func:`tasks.sweep`'s ``pack``); ``max_concurrent`` then defaults to
            that many trials per slot. A study that samples a param the job's models' shapes
            hang on runs unpacked, and ``handle.packing.reason`` says why.
        constraints: what a device must be to run a trial (as :func:`tasks.sweep`'s).
        app: the Celery app to send through; default ``client``'s, else ``tasks.app``.
        client: the :class:`~tasks.producer.client.FleetClient` whose connections the handle
            uses; default the app's own.

    Raises:
        MissingExtra: Optuna is not installed.
        ConfigError: a bad space, direction, objective or count, or a ``pack`` that
            :func:`tasks.sweep` refuses (a bad count, a job or command that does not pack).
        DeviceUnavailable, PlacementUnavailable, UnknownJob, InvalidJobArguments: as for :func:`tasks.fan_out` (nothing is
            sent; the fixed kwargs are checked, the sampled ones are the study's).
        SweepConflict: a study of that name exists for another job.
    """
    optuna = require_optuna()
    app = app or (client.app if client is not None else default_app())
    connections = client if client is not None and client.app is app else Connections.of(app)
    parse_pack(pack)  # a bad value is refused before the registry is read
    distributions = parse_space(space)
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ConfigError(f"n_trials={n_trials!r}: give a whole number of at least 1")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"direction={direction!r}: use 'maximize' or 'minimize'")
    if not isinstance(objective, str) or not objective:
        raise ConfigError(f"objective={objective!r}: name the field of the job's output to optimize")
    base = JobSpec.sharing(constrained(prioritized(job, priority, user), constraints), kwargs)
    clash = sorted(set(distributions) & set(base.kwargs))
    if clash:
        raise ConfigError(f"{', '.join(clash)} both in the space and in the fixed kwargs: keep one")
    live = live_devices(client=connections)
    chosen = serving_placed(connections.redis, devices, live, base)
    groups = trial_groups(chosen, live, group, base, devices)
    if groups is not None:
        chosen = [device for choice in groups for device in choice.devices]
    # A command's placeholders are filled from the space: check them with a value for each.
    probe = JobSpec.of(base, {**base.kwargs, **dict.fromkeys(distributions, 0)}) if base.name == COMMAND_JOB else base
    check_jobs({device: probe for device in chosen}, live)
    check_kwargs(connections.redis, [(device, base, "") for device in chosen], sampled=list(distributions))
    packing = plan_study_packing(pack, base, list(distributions), chosen, live, group)
    # Every slot of every chosen device busy (a device with 4 slots runs 4 trials at once), with
    # a pack's worth of trials each when packed.
    per_slot = 1 if not packing.packed else PACK_AUTO_MAX if packing.pack == "auto" else int(packing.pack or 1)
    limit = (max_concurrent if max_concurrent is not None else len(groups) if groups is not None
             else per_slot * sum(live[device].slot_count for device in chosen))
    if limit < 1:
        raise ConfigError(f"max_concurrent={max_concurrent!r}: give at least 1")
    study_name = name or f"{base.name}-{uuid.uuid4().hex[:8]}"
    study = optuna.create_study(study_name=study_name, storage=journal_storage(app), direction=direction,
                                sampler=sampler, pruner=make_pruner(pruner), load_if_exists=True)
    owner = study.user_attrs.get(JOB_ATTR)
    if owner is not None and owner != base.name:
        raise SweepConflict(f"study {study_name!r} is a study of job {owner!r}, not {base.name!r}: "
                            "give another name (nothing was sent)")
    study.set_user_attr(JOB_ATTR, base.name)
    credentials = credentials_of(app)  # a user's study: its queue and trial ids are theirs
    queue_id = owned_id(f"optuna-{study_name}", credentials.user if credentials is not None else None)
    # A packed study's queue holds only its trials: the worker that takes one pulls its siblings;
    # a placed one's too, so that only the matching devices (and none that joins later) take them.
    queue = TrialQueue(app, queue_id, chosen, live, queue=sweep_queue(queue_id) if packing.packed else None,
                       connections=connections, level=base.level, groups=groups,
                       own=base.options.constraints is not None)
    queue.attach()
    handle = StudyHandle(_StudyRun(optuna, study, queue, packed_spec(base, packing), distributions, objective,
                                   n_trials, limit, on_update, packing))
    handle._read()  # the first trials go out now
    return handle


def optimize(
    job: JobLike,
    space: Mapping[str, Any],
    n_trials: int,
    objective: str,
    *,
    timeout: float | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> optuna.Study:
    """Run an Optuna study of ``n_trials`` trials of ``job``; return the study when it has them.

    :func:`start_study` and ``handle.get(timeout)``; the other arguments are
    :func:`start_study`'s (``on_update`` is called after every read, for a live view).

    Args:
        timeout: seconds to wait in all; then :class:`FanOutTimeout` (the study keeps what
            ended; its running trials go on, and the same call with the same name adopts them).
        stop: once set, the running trials are cancelled and the study returned as it is.

    Raises:
        ConfigError: as :func:`start_study`; or the job's output has no number ``objective``, or
            refuses a parameter (the running trials are cancelled).
        FanOutTimeout: ``timeout`` passed.
    """
    handle = start_study(job, space, n_trials, objective, **options)
    try:
        return handle.get(timeout, stop=stop)
    except FanOutTimeout:
        raise  # the running trials go on; the same call with the same name adopts them
    except BaseException:  # Ctrl-C: the running trials are cancelled
        handle.cancel("the study's producer stopped")
        raise
    finally:
        handle.queue.detach()


async def optimize_async(job: JobLike, space: Mapping[str, Any], n_trials: int, objective: str, *,
                         timeout: float | None = None, cancel: bool = False, **options: Any) -> optuna.Study:
    """:func:`optimize` from async code: ``await start_study(...).wait(timeout, cancel=cancel)``
    (the study is sent from a thread: Optuna's storage is blocking).

    Cancelling the awaiting task leaves the study running to its end, driven from a thread, as a
    fan-out's jobs go on; with ``cancel=True`` it stops the study too and cancels its running
    trials (they end ``FAIL`` with ``user_attrs["cancelled"]``). The other arguments are
    :func:`start_study`'s.
    """
    handle = await asyncio.to_thread(start_study, job, space, n_trials, objective, **options)
    try:
        return await handle.wait(timeout, cancel=cancel)
    except asyncio.CancelledError:
        if not cancel:
            threading.Thread(target=handle.run_to_end, name=f"study-{handle.id}", daemon=False).start()
        raise


def _tell(study: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
    """``study.tell``. A sampler that ends its own search (GridSampler, BruteForceSampler) calls
    ``study.stop()`` once the last point is told, which Optuna refuses outside
    ``study.optimize``; the trial is stored by then, and this loop stops at ``n_trials``."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


class _StudyRun:
    """One producer's run of a study: ask, send, read, report, prune, tell (its :meth:`step`)."""

    def __init__(self, optuna: Any, study: Any, queue: TrialQueue, base: JobSpec, distributions: dict[str, Any],
                 objective: str, n_trials: int, limit: int,
                 on_update: Callable[[StudyProgress], None] | None, packing: Packing | None = None) -> None:
        self.optuna = optuna
        #: What ``pack=`` did (``base``'s options carry its ``pack``).
        self.packing = packing or Packing(None, "unpacked")
        self.study = study
        self.queue = queue
        self.base = base
        self.distributions = distributions
        self.objective = objective
        self.n_trials = n_trials
        self.limit = limit
        self.on_update = on_update
        self.pruning = not isinstance(study.pruner, optuna.pruners.NopPruner)
        self.in_flight: dict[int, _InFlight] = {}
        self.progress = StudyProgress(name=study.study_name, n_trials=n_trials)
        self._adopt()

    def _adopt(self) -> None:
        """Count the study's finished trials; send its running ones again (same task ids)."""
        TrialState = self.optuna.trial.TrialState
        again = []
        for frozen in self.study.get_trials(deepcopy=False):
            if frozen.state.is_finished():
                self._count(frozen.state, frozen.user_attrs.get("device"))
            elif frozen.state == TrialState.RUNNING:
                trial = self.optuna.trial.Trial(self.study, frozen._trial_id)
                flight = _InFlight(trial, self.queue.task_id(frozen.number),
                                   reported=set(frozen.intermediate_values))
                self.in_flight[frozen.number] = flight
                again.append((frozen.number, self._spec(frozen.params)))
        if again:
            logger.info("study %s: adopting %d running trials", self.study.study_name, len(again))
            self.queue.send(again)
        self._best()

    def _spec(self, params: Mapping[str, Any]) -> JobSpec:
        return JobSpec.of(self.base, {**self.base.kwargs, **params})

    def _count(self, state: Any, device: str | None) -> None:
        TrialState = self.optuna.trial.TrialState
        p = self.progress
        p.finished += 1
        if state == TrialState.COMPLETE:
            p.complete += 1
        elif state == TrialState.PRUNED:
            p.pruned += 1
        else:
            p.failed += 1
        if device:
            p.devices[device] = p.devices.get(device, 0) + 1

    def _best(self) -> None:
        try:
            best = self.study.best_trial
        except ValueError:  # no complete trial yet
            return
        self.progress.best_value, self.progress.best_params = best.value, dict(best.params)

    def step(self, metas: Mapping[str, Meta | None]) -> bool:
        """Tell Optuna what finished, report intermediate values, prune; ask for and send trials
        while there is room. True if trials were sent."""
        self._poll(metas)
        asked = []
        while len(self.in_flight) < self.limit and self.progress.finished + len(self.in_flight) < self.n_trials:
            trial = self.study.ask(self.distributions)
            self.in_flight[trial.number] = _InFlight(trial, self.queue.task_id(trial.number))
            asked.append((trial.number, self._spec(trial.params)))
        if asked:
            self.queue.send(asked)
        self.queue.refresh()
        if self.on_update is not None:
            self.on_update(self.progress)
        return bool(asked)

    @property
    def done(self) -> bool:
        return self.progress.finished >= self.n_trials

    def due(self, metas: Mapping[str, Meta | None]) -> bool:
        """Whether :meth:`step` has anything to do with ``metas`` (from any thread)."""
        flights = dict(self.in_flight)  # one copy: a step in a thread may change it
        if len(flights) < self.limit and self.progress.finished + len(flights) < self.n_trials:
            return True
        for flight in flights.values():
            meta = metas.get(flight.task_id)
            if entry_of(meta) is not None:
                return True
            report = meta.get("result") if meta is not None and state_of(meta) == PROGRESS_STATE else None
            values = report.get("values") if isinstance(report, dict) else None
            if isinstance(values, list) and not flight.pruning and any(
                    isinstance(p, list) and len(p) == 2 and int(p[0]) not in flight.reported for p in values):
                return True
        return self.queue.refresh_due()

    def _poll(self, metas: Mapping[str, Meta | None]) -> None:
        """Tell Optuna what finished, report intermediate values, prune."""
        ids = {flight.task_id: number for number, flight in self.in_flight.items()}
        reports = self.queue.reports(list(ids))
        for task_id, number in ids.items():
            flight = self.in_flight[number]
            meta = metas.get(task_id)
            entry = entry_of(meta)
            self.progress.running[number] = self.queue.device_of(meta)
            if task_id in reports:  # the last values of a finished trial too, before it is told
                self._report(flight, reports[task_id], prune=entry is None and self.pruning)
            if entry is not None:
                self._finish(flight, entry)

    def _report(self, flight: _InFlight, report: Mapping[str, Any], prune: bool) -> None:
        """Report each intermediate value not reported yet; revoke the trial if it should be pruned."""
        values = report.get("values")
        if not isinstance(values, list) or flight.pruning:
            return
        for pair in values:
            if isinstance(pair, list) and len(pair) == 2 and int(pair[0]) not in flight.reported:
                flight.trial.report(float(pair[1]), int(pair[0]))
                flight.reported.add(int(pair[0]))
        if prune and flight.reported and flight.trial.should_prune():
            flight.pruning = True
            logger.info("study %s: pruning trial %d", self.study.study_name, flight.trial.number)
            revoke(self.queue.app, self.queue.connections.redis, [flight.task_id])

    def _finish(self, flight: _InFlight, entry: dict[str, Any]) -> None:
        TrialState = self.optuna.trial.TrialState
        trial, number = flight.trial, flight.trial.number
        del self.in_flight[number]
        self.progress.running.pop(number, None)
        device = entry.get("device")
        trial.set_user_attr("device", device)
        trial.set_user_attr("task_id", flight.task_id)
        output = entry.get("output") or {}
        status = Entry.parse(entry).status
        if status is EntryStatus.OK:
            value = output.get(self.objective)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                _tell(self.study, trial, state=TrialState.FAIL)
                self._count(TrialState.FAIL, device)
                fields = ", ".join(sorted(output)) or "no fields"
                raise ConfigError(
                    f"objective {self.objective!r} is not a number in the output of job {self.base.name!r} "
                    f"(trial {number} returned {fields}); name one of its number fields"
                )
            _tell(self.study, trial, float(value))
            state = TrialState.COMPLETE
        elif status is EntryStatus.CANCELLED and flight.pruning:
            _tell(self.study, trial, state=TrialState.PRUNED)
            state = TrialState.PRUNED
        else:
            error = entry.get("error") or {}
            trial.set_user_attr("error", f"{error.get('type')}: {error.get('message')}")
            _tell(self.study, trial, state=TrialState.FAIL)
            state = TrialState.FAIL
            if error.get("type") == "InvalidJobArguments":
                self._count(state, device)
                raise ConfigError(f"job {self.base.name!r} refused trial {number}'s parameters "
                                  f"{trial.params}: {error.get('message')}")
        self._count(state, device)
        self._best()

    def cancel(self, reason: str) -> None:
        """Cancel the running trials and end them FAIL in the study (with ``cancelled`` set)."""
        if not self.in_flight:
            return
        try:
            self.queue.cancel([f.task_id for f in self.in_flight.values()], reason=reason)
            for flight in self.in_flight.values():
                flight.trial.set_user_attr("cancelled", reason)
                _tell(self.study, flight.trial, state=self.optuna.trial.TrialState.FAIL, skip_if_finished=True)
        except Exception as exc:  # noqa: BLE001  (already leaving with an error)
            logger.warning("study %s: could not cancel the running trials: %s", self.study.study_name, exc)
        self.in_flight.clear()


class StudyHandle(JobHandle[int, "optuna.Study"]):
    """A running study (:func:`start_study`): its trials are its jobs, by trial number, and
    :meth:`get` (or ``await handle``) returns the :class:`optuna.Study` once it has ``n_trials``
    finished trials. The rest of its API is :class:`~tasks.producer.handle.JobHandle`'s.

    The study advances as the handle is read: each read tells Optuna what finished, hands it
    the intermediate values (pruning), and asks for the next trials (from a thread when
    awaited: Optuna's storage and samplers are blocking). Awaited, that happens when the
    listener hears a trial's state, not at an interval. The jobs are this run's trials (a
    resumed study's earlier trials are in the study); ``summary()`` counts the trials not asked
    for yet as queued. A job's output without a number ``objective`` (or parameters the job
    refuses) ends the run: its running trials are cancelled, and ``get()``/``await`` raise
    :class:`~tasks.core.errors.ConfigError`.
    """

    progress_of_every_job = False

    def __init__(self, run: _StudyRun) -> None:
        super().__init__(run.queue.app, run.queue.connections, run.queue.reader)
        self.run = run
        self.queue = run.queue
        #: ``{trial number: task id}``, replaced (never changed in place) as trials are asked for.
        self._jobs = {n: f.task_id for n, f in sorted(run.in_flight.items())}
        self._ended = False  # the study has its trials, was cancelled, or failed
        self._error: BaseException | None = None
        self._advancing = threading.Lock()

    @property
    def study(self) -> optuna.Study:
        return self.run.study

    @property
    def id(self) -> str:
        return str(self.run.study.study_name)

    @property
    def packing(self) -> Packing:
        """What ``pack=`` did: ``packing.reason`` is ``"packed 8"``, or why the trials run unpacked."""
        return self.run.packing

    @property
    def devices(self) -> list[str]:
        return self.queue.devices

    @property
    def progress_view(self) -> StudyProgress:
        """Counts by Optuna's trial states, the running trials, the best so far."""
        return self.run.progress

    def jobs(self) -> dict[int, str]:
        return self._jobs

    def states(self) -> dict[int, str]:
        """Each asked trial's Celery state, by trial number (one read for all)."""
        return self._states(self._read())

    async def astates(self) -> dict[int, str]:
        return self._states(await self._aread())

    def _device_of(self, meta: Meta | None) -> str | None:
        return self.queue.device_of(meta)

    def _name(self, key: int) -> str:
        return f"trial {key}"

    # -- advancing ----------------------------------------------------------------------------

    def _advance(self, metas: Mapping[str, Meta | None]) -> bool:
        with self._advancing:
            if self._ended:
                return False
            try:
                sent = self.run.step(metas)
            except Exception as exc:  # noqa: BLE001  (a bad objective...: kept for get() and await)
                self._error = exc
                self._end(f"study {self.id} failed: {exc}")
                return False
            self._jobs = {**self._jobs, **{n: f.task_id for n, f in sorted(self.run.in_flight.items())
                                           if n not in self._jobs}}
            if self.run.done:
                self._end(None)
            return sent

    def _advance_due(self, metas: Mapping[str, Meta | None]) -> bool:
        return not self._ended and self.run.due(metas)

    def _end(self, cancel_reason: str | None) -> None:
        """The run is over (called holding the lock): cancel what runs, let the queue go."""
        self._ended = True
        if cancel_reason is not None:
            self.run.cancel(cancel_reason)
        self.queue.detach()

    def _all_final(self, metas: Mapping[str, Meta | None]) -> bool:
        """Done when the study has its trials and every trial sent has ended (a cancelled
        study's too), or at once when it failed."""
        return self._error is not None or (self._ended and super()._all_final(metas))

    def _summary(self, metas: Mapping[str, Meta | None]) -> Summary:
        out = super()._summary(metas)
        if not self._ended:
            unasked = max(0, self.run.n_trials - self.run.progress.finished - len(self.run.in_flight))
            out.total += unasked
            out.queued += unasked
        return out

    def _result(self, metas: Mapping[str, Meta | None]) -> optuna.Study:
        if self._error is not None:
            raise self._error
        return self.run.study

    # -- the blocking API ---------------------------------------------------------------------

    def get(self, timeout: float | None = None, *, stop: threading.Event | None = None) -> optuna.Study:
        """Run the study until it has ``n_trials`` finished trials; return it.

        Args:
            timeout: seconds to wait; then :class:`FanOutTimeout` (the trials go on, and the study
                goes on when the handle is read again).
            stop: once set, the running trials are cancelled and the study returned as it is.

        Raises:
            ConfigError: the job's output has no number ``objective``, or the job refused a
                trial's parameters (the running trials were cancelled).
            FanOutTimeout: ``timeout`` passed first.
        """
        study = self._poll_until_final(timeout, stop)
        if stop is not None and stop.is_set():
            self.cancel("the study was stopped")
        return study

    def run_to_end(self) -> None:
        """:meth:`get`, logging what it raises (a thread that carries the study on)."""
        try:
            self.get()
        except Exception as exc:  # noqa: BLE001
            logger.warning("study %s: %s", self.id, exc)

    def cancel(self, reason: str | None = None) -> None:
        """Stop asking for trials; queued trials never start, running ones stop at their next
        ``ctx.progress()`` and end ``FAIL`` in the study with ``user_attrs["cancelled"]``."""
        with self._advancing:
            if not self._ended:
                self._end(reason or f"study {self.id} cancelled")

    def __repr__(self) -> str:
        return f"<StudyHandle {self.id} {self.run.base.name} {self.run.progress.finished}/{self.run.n_trials}>"
