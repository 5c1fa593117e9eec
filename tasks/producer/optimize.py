"""Optuna studies over the fleet: Optuna picks each trial's parameters, a free device runs it.

::

    import tasks
    study = tasks.optimize("train", {"lr": {"low": 1e-3, "high": 0.3, "log": True},
                                     "model": ["mlp", "cnn"]},
                           n_trials=40, objective="accuracy", pruner="median", name="lr-model")
    study.best_trial.params, study.best_value

The study is a real :class:`optuna.Study`, kept in the fleet's Redis by Optuna's own journal
storage (``JournalRedisBackend``, keys under :data:`tasks.core.keys.OPTUNA_PREFIX`), so
``optuna.load_study(study_name=..., storage=tasks.producer.optimize.journal_storage(app))``,
``study.trials_dataframe()`` and optuna-dashboard read it. This producer asks Optuna for a
trial's parameters, runs the trial as a job on the study's queue (:mod:`tasks.producer.trials`:
the next free device takes it), and tells Optuna the ``objective`` field of the job's output.

Pruning: a job reports intermediate values with ``ctx.progress(step=..., value=...)``; each new
step is reported to the trial (``trial.report``) and, when the pruner says so, the trial's job is
revoked. It stops at its next ``ctx.progress()`` (its device's memory is released before the
device takes the next trial) and the trial ends ``PRUNED``.

Resume: the same call with the same ``name`` loads the study, adopts the trials still running
(sent again under the same task id: a copy of a trial that runs or ran is dropped by the
worker's lease) and asks for trials until ``n_trials`` have finished in all.

Optuna is the ``sweep`` extra: ``pip install 'devicefleet[sweep]'``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery

from ..core import keys
from ..core.app import redis_url_of
from ..core.commands import COMMAND_JOB
from ..core.errors import ConfigError, FanOutTimeout, MissingExtra, SweepConflict
from .fanout import ALL, JobLike, JobSpec, check_jobs, live_devices, select_devices
from .sweep import MAX_POLL_S, MIN_POLL_S
from .trials import TrialQueue, entry_of, trial_task_id

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
    """Optuna's journal storage in the fleet's Redis (what ``optuna.load_study`` takes)."""
    optuna = require_optuna()
    from optuna.storages.journal import JournalRedisBackend

    with warnings.catch_warnings():  # the Redis journal backend is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        backend = JournalRedisBackend(redis_url_of(app), prefix=keys.OPTUNA_PREFIX)
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


def optimize(
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
    timeout: float | None = None,
    on_update: Callable[[StudyProgress], None] | None = None,
    app: Celery | None = None,
    stop: threading.Event | None = None,
) -> optuna.Study:
    """Run an Optuna study of ``n_trials`` trials of ``job`` over ``devices``; return the study.

    Args:
        job: the job; ``kwargs`` are the kwargs every trial shares.
        space: ``{parameter: distribution}`` (see :func:`parse_space`); each trial's parameters
            are passed to the job as kwargs.
        n_trials: trials the study has when this returns (a resumed study counts those it had).
        objective: the field of the job's output that is the trial's value.
        direction: ``maximize`` or ``minimize``.
        pruner: an Optuna pruner or ``median``, ``asha``, ``hyperband``; None: no pruning.
        sampler: an Optuna sampler (default Optuna's, TPE).
        name: the study's name in the fleet's Redis; the same name resumes it.
        max_concurrent: trials running at once (default: one per slot of each device).
        timeout: seconds to wait in all; then :class:`FanOutTimeout` (the study keeps what ended).
        on_update: called with a :class:`StudyProgress` after every poll (for a live view).
        stop: once set, the running trials are cancelled and the study returned as it is
            (:func:`optimize_async` sets it when its awaiting task is cancelled with ``cancel=True``).

    Raises:
        MissingExtra: Optuna is not installed.
        ConfigError: a bad space, direction, objective or count; or the job's output has no
            number ``objective``, or refuses a parameter (the running trials are cancelled).
        DeviceUnavailable, UnknownJob: as for :func:`tasks.fan_out` (nothing is sent).
        SweepConflict: a study of that name exists for another job.
    """
    optuna = require_optuna()
    from .fanout import _default_app

    app = app or _default_app()
    distributions = parse_space(space)
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ConfigError(f"n_trials={n_trials!r}: give a whole number of at least 1")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"direction={direction!r}: use 'maximize' or 'minimize'")
    if not isinstance(objective, str) or not objective:
        raise ConfigError(f"objective={objective!r}: name the field of the job's output to optimize")
    base = JobSpec.sharing(job, kwargs)
    clash = sorted(set(distributions) & set(base.kwargs))
    if clash:
        raise ConfigError(f"{', '.join(clash)} both in the space and in the fixed kwargs: keep one")
    live = live_devices(app)
    chosen = select_devices(devices, live)
    # A command's placeholders are filled from the space: check them with a value for each.
    probe = JobSpec.of(base, {**base.kwargs, **dict.fromkeys(distributions, 0)}) if base.name == COMMAND_JOB else base
    check_jobs({device: probe for device in chosen}, live)
    # Every slot of every chosen device busy (a device with 4 slots runs 4 trials at once).
    limit = max_concurrent if max_concurrent is not None else sum(live[device].slot_count for device in chosen)
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
    queue = TrialQueue(app, f"optuna-{study_name}", chosen, live)
    queue.attach()
    run = _StudyRun(optuna, study, queue, base, distributions, objective, n_trials, limit, on_update,
                    stop or threading.Event())
    try:
        run.loop(None if timeout is None else time.monotonic() + timeout, timeout)
    except _Stopped:
        run.cancel("the study was stopped")
    except FanOutTimeout:
        raise  # the running trials go on; the same call with the same name adopts them
    except BaseException:  # Ctrl-C, a bad objective: the running trials are cancelled
        run.cancel("the study's producer stopped")
        raise
    finally:
        queue.detach()
    return study


class _Stopped(Exception):
    """The study's ``stop`` event was set (control flow inside :func:`optimize`)."""


async def optimize_async(job: JobLike, space: Mapping[str, Any], n_trials: int, objective: str, *,
                         cancel: bool = False, **options: Any) -> optuna.Study:
    """:func:`optimize` from async code: the study's loop runs in a thread (Optuna's storage and
    sampler are blocking); the event loop awaits it.

    Cancelling the awaiting task leaves the study running to its end in its thread, as a
    fan-out's jobs go on; with ``cancel=True`` it stops the study too and cancels its running
    trials (they end ``FAIL`` with ``user_attrs["cancelled"]``). The other arguments are
    :func:`optimize`'s.
    """
    stop = threading.Event()
    run = functools.partial(optimize, job, space, n_trials, objective, stop=stop, **options)
    try:
        return await asyncio.get_running_loop().run_in_executor(None, run)
    except asyncio.CancelledError:
        if cancel:
            logger.info("the awaiting task was cancelled: stopping the study")
            stop.set()
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
    """One producer's loop over a study: ask, send, poll, report, prune, tell."""

    def __init__(self, optuna: Any, study: Any, queue: TrialQueue, base: JobSpec, distributions: dict[str, Any],
                 objective: str, n_trials: int, limit: int,
                 on_update: Callable[[StudyProgress], None] | None, stop: threading.Event) -> None:
        self.optuna = optuna
        self.stop = stop
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
                flight = _InFlight(trial, trial_task_id(self.queue.id, frozen.number),
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

    def loop(self, deadline: float | None, timeout: float | None) -> None:
        pause = MIN_POLL_S
        while self.progress.finished < self.n_trials:
            while len(self.in_flight) < self.limit and self.progress.finished + len(self.in_flight) < self.n_trials:
                trial = self.study.ask(self.distributions)
                flight = _InFlight(trial, trial_task_id(self.queue.id, trial.number))
                self.in_flight[trial.number] = flight
                self.queue.send([(trial.number, self._spec(trial.params))])
            changed = self._poll()
            self.queue.refresh()
            if self.on_update is not None:
                self.on_update(self.progress)
            if self.progress.finished >= self.n_trials:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise FanOutTimeout(timeout or 0.0, [f"trial {n}" for n in self.in_flight])
            pause = MIN_POLL_S if changed else min(MAX_POLL_S, pause * 2)
            if self.stop.wait(pause):
                raise _Stopped

    def _poll(self) -> bool:
        """Tell Optuna what finished, report intermediate values, prune; True if any ended."""
        ids = {flight.task_id: number for number, flight in self.in_flight.items()}
        metas = self.queue.metas(list(ids))
        reports = self.queue.reports(list(ids))
        changed = False
        for task_id, number in ids.items():
            flight = self.in_flight[number]
            entry = entry_of(metas[task_id])
            self.progress.running[number] = self.queue.device_of(metas[task_id])
            if task_id in reports:  # the last values of a finished trial too, before it is told
                self._report(flight, reports[task_id], prune=entry is None and self.pruning)
            if entry is not None:
                self._finish(flight, entry)
                changed = True
        return changed

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
            self.queue.app.control.revoke([flight.task_id])

    def _finish(self, flight: _InFlight, entry: dict[str, Any]) -> None:
        TrialState = self.optuna.trial.TrialState
        trial, number = flight.trial, flight.trial.number
        del self.in_flight[number]
        self.progress.running.pop(number, None)
        device = entry.get("device")
        trial.set_user_attr("device", device)
        trial.set_user_attr("task_id", flight.task_id)
        output = entry.get("output") or {}
        if entry["status"] == "ok":
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
        elif entry["status"] == "cancelled" and flight.pruning:
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
