"""Sending work to the fleet: ``run`` (a fan-out), ``sweep`` (trials) and ``optimize`` (an Optuna
study), with the job or a program after ``--``, and the waits that a Ctrl-C cancels."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ..core.defaults import CANCEL_WAIT_S, RUN_TIMEOUT_S, SWEEP_TIMEOUT_S
from ..core.errors import EXIT_CONFIG, EXIT_INTERRUPTED, DeviceFleetError
from ..core.placement import parse_requirements
from ..core.priority import DEFAULT_LEVEL, Level
from ..core.records import DistBackend
from ..core.settings import Settings
from ..ops import fleet_lost
from ..ops.log_view import print_logs
from ..ops.sweep_view import StudyView, ranked_table, study_rows, sweep_rows, watch_sweep
from ..producer.commands import command
from ..producer.fanout import fan_out
from ..producer.optimize import optimize as run_study
from ..producer.optimize import require_optuna
from ..producer.sweep import grid
from ..producer.sweep import sweep as start_sweep
from .helpers import console, err_console, fail, load_settings
from .results import exit_code, print_results, producer_app, watch_progress


class _TakesCommand(click.Command):
    """A command whose words after ``--`` are a program to run on the fleet
    (``devicefleet run -- python train.py --lr 0.1``): kept whole, never parsed as options."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta["devicefleet.argv"] = args[at + 1:]
            args = args[:at]
        return super().parse_args(ctx, args)


def _command_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--env`` and ``--cwd``, for a command given after ``--``."""
    func = click.option("--cwd", help="With -- CMD: working directory, absolute or under the workers' first "
                        "allowed folder (their config's commands.workdirs) [default: that folder].")(func)
    return click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
                        help="With -- CMD: a variable for the command's environment (repeatable).")(func)


def _priority_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--priority`` and ``--user``: the jobs' level and who they are counted to."""
    func = click.option("--user", help="Who the jobs are counted to (devicefleet status) [default: "
                        "DEVICEFLEET_USER, else your OS user].")(func)
    return click.option("--priority", type=click.Choice([level.value for level in Level], case_sensitive=False),
                        default=DEFAULT_LEVEL.value, show_default=True,
                        help="The jobs' level: a free device takes urgent work first, batch work last.")(func)


def _require_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--require KEY=VALUE`` (repeatable): what a device must be to run the jobs
    (:mod:`tasks.core.placement`)."""
    return click.option("--require", "require", multiple=True, metavar="KEY=VALUE",
                        help="Run only on devices that are this (repeatable): min_memory_gib=40, gpu_model=H100, "
                             "kind=gpu, min_compute_capability=8.0, host=NAME, label.NAME=VALUE.")(func)


def _constraints(require: tuple[str, ...]) -> Any:
    """``--require``'s items as :class:`~tasks.core.placement.Constraints` (None without any).

    Raises:
        ConfigError: an item is not KEY=VALUE, or names an unknown key or a bad value.
    """
    return parse_requirements(require) if require else None


def _job_or_command(job: str | None, env_pairs: tuple[str, ...], cwd: str | None) -> Any:
    """JOB, or the command after ``--`` (a :func:`tasks.command` job).

    Raises:
        click.UsageError: neither or both were given, or --env/--cwd without a command.
    """
    argv = click.get_current_context().meta.get("devicefleet.argv")
    if argv is None:
        if job is None:
            raise click.UsageError("give a JOB, or a command after --: devicefleet run -- python train.py")
        if env_pairs or cwd is not None:
            raise click.UsageError("--env and --cwd go with a command after --")
        return job
    if job is not None:
        raise click.UsageError(f"give a JOB ({job!r}) or a command after --, not both")
    if not argv:
        raise click.UsageError("nothing after --: name the program to run, e.g. -- python train.py")
    env: dict[str, str] = {}
    for pair in env_pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        env[name] = value
    try:
        return command(argv, cwd=cwd, env=env)
    except DeviceFleetError as exc:
        fail(exc, EXIT_CONFIG)


def _parse_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not JSON: {exc}", param_hint="--kwargs") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{text!r} is not a JSON object", param_hint="--kwargs")
    return value


@click.command(cls=_TakesCommand)
@click.argument("job", required=False)
@_command_options
@click.option("--kwargs", "kwargs_text", help='Job kwargs as a JSON object, e.g. \'{"epochs": 5}\'.')
@click.option("--devices", default="all", show_default=True, help="all, cpu, gpu, or names: cpu0,gpu0.")
@click.option("--timeout", type=float, default=RUN_TIMEOUT_S, show_default=True, help="Seconds to wait for every device.")
@click.option("--json", "as_json", is_flag=True, help="Print the result dict as JSON.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Live progress bar per device (on stderr).")
@click.option("--fallback", type=click.Choice(["cpu"]), help="On out-of-memory, run the job again on the CPU.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True),
              help="Seconds a job may run; then it ends as JobTimeout [default: the worker config's max_job_seconds].")
@click.option("--max-attempts", type=click.IntRange(1, 100),
              help="Runs that may take their whole worker down before the job ends as WorkerLost [default: 3].")
@click.option("--per-slot", is_flag=True,
              help="Run one copy of JOB per slot of each device, at once (keys DEVICE/N).")
@click.option("--distributed", is_flag=True,
              help="Run JOB once over all DEVICES as the ranks of one torch.distributed group (DDP).")
@click.option("--group", type=click.IntRange(2, 64),
              help="Run JOB over this many DEVICES of one host at once, in one process that sees them all "
                   "(keys cpu0+cpu1).")
@click.option("--backend", type=click.Choice([b.value for b in DistBackend]),
              help="With --distributed: gloo or nccl [default: auto, nccl when every rank is a GPU, else gloo].")
@click.option("--max-restarts", type=click.IntRange(0, 100),
              help="With --distributed: times the gang runs again after a rank's worker died [default: 2].")
@click.option("--join-timeout", type=click.FloatRange(min=0, min_open=True),
              help="With --distributed: seconds a rank waits for the others to start [default: 120].")
@_priority_options
@_require_option
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def run(job: str | None, env_pairs: tuple[str, ...], cwd: str | None, kwargs_text: str | None, devices: str,
        timeout: float, as_json: bool, progress: bool, fallback: str | None, time_limit: float | None,
        max_attempts: int | None, per_slot: bool, distributed: bool, group: int | None, backend: str | None,
        max_restarts: int | None, join_timeout: float | None, priority: str, user: str | None,
        require: tuple[str, ...], redis_url: str | None) -> None:
    """Fan JOB out to DEVICES and print {device: entry}. Exits 2 if refused before anything was
    sent (a bad value), 1 if any device failed, 3 if the fleet went away before every device
    reported (or there is none), 130 after Ctrl-C (which cancels the fan-out).

    Or run a program: devicefleet run --devices cpu -- python train.py --lr 0.1. Its output is
    printed as it comes, each line after its device ([cpu0]; on stderr with --json), and kept
    whole in each device's artifacts folder. The workers' config must allow the program
    ([commands] in worker_configs/).
    """
    target = _job_or_command(job, env_pairs, cwd)
    is_command = not isinstance(target, str)
    if is_command and kwargs_text:
        raise click.UsageError("--kwargs goes with a JOB; give a command's arguments after --")
    kwargs = _parse_kwargs(kwargs_text) if not is_command else None
    settings = load_settings(redis_url=redis_url, user=user)
    given = {"backend": backend, "max_restarts": max_restarts, "join_timeout_s": join_timeout}
    gang: dict[str, Any] | bool = {k: v for k, v in given.items() if v is not None} if distributed else False
    if not distributed and any(v is not None for v in given.values()):
        raise click.UsageError("--backend, --max-restarts and --join-timeout go with --distributed")
    app = producer_app(settings)
    options = {"fallback": fallback, "time_limit_s": time_limit, "max_attempts": max_attempts}
    with _interrupt_held() as pressed:  # a Ctrl-C before the wait's own handler cancels what was sent
        handle = fan_out(target, devices, kwargs=kwargs,
                         options={k: v for k, v in options.items() if v is not None} or None,
                         distributed=gang, per_slot=per_slot, group=group, priority=priority,
                         constraints=_constraints(require), app=app)
        if is_command:
            watch: Callable[[], None] | None = lambda: _print_logs(handle, timeout, as_json)  # noqa: E731
        else:
            watch = (lambda: watch_progress(handle, timeout)) if progress else None
        results, cancelled = _wait_or_cancel(handle, "the fan-out", timeout, watch, settings, pressed)
    print_results(results, as_json)
    raise SystemExit(exit_code(results.values(), cancelled))


def _print_logs(handle: Any, timeout: float, as_json: bool) -> None:
    """Each command's lines as they come, after their device: stdout's on stdout, stderr's on
    stderr (both on stderr with ``--json``, whose stdout is one JSON document)."""
    print_logs(handle, timeout, sys.stderr if as_json else sys.stdout, sys.stderr)


def _wait_or_cancel(handle: Any, what: str, timeout: float, watch: Callable[[], None] | None,
                    settings: Settings, interrupted: threading.Event | None = None) -> tuple[Any, bool]:
    """``(handle.get(timeout), False)``, after ``watch()`` draws it; on Ctrl-C (or ``interrupted``
    set: one came before this wait's handler, :func:`_interrupt_held`), says so, cancels the
    handle and returns ``(what it collected, True)``.

    Raises:
        FleetLost: the fleet went away meanwhile (:mod:`tasks.ops.fleet_lost`).
    """
    # The handler that raises lives only inside the try: a Ctrl-C that came while the fleet's
    # watch was being set up, or between the handler's install and the try, raised outside it
    # before, and the command ended as click's "Aborted!" (exit 1) with the jobs still running.
    with fleet_lost.watching_the_fleet(settings, what):
        try:
            with _say_on_interrupt(what) as interrupt:
                if interrupted is not None and interrupted.is_set():  # read once this handler is in place
                    interrupt()
                if watch is not None:
                    watch()
                return handle.get(timeout=timeout), False
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
            # The interrupt may have come between one of the wait's Redis commands and its reply,
            # which redis-py leaves unread in a connection it hands back to its pool: the cancel's
            # first command then read it as its own (a sweep's cancel failed on an MGET's list).
            handle.drop_connections()
            handle.cancel()
            return handle.get(timeout=CANCEL_WAIT_S), True


@contextlib.contextmanager
def _say_on_interrupt(what: str) -> Iterator[Callable[[], None]]:
    """Ctrl-C says that ``what`` is being cancelled, then raises KeyboardInterrupt as usual;
    yields that reaction, for a Ctrl-C that came earlier (:func:`_interrupt_held`)."""
    def interrupted(signum: int = signal.SIGINT, frame: Any = None) -> None:
        err_console.print(f"[bold yellow]interrupted:[/] cancelling {what}: queued jobs never start, "
                          "running ones stop at their next ctx.progress() or are ended after the workers' "
                          "grace period (Ctrl-C again to stop waiting)", highlight=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _interrupt_held() -> Iterator[threading.Event]:
    """While jobs are being sent, a Ctrl-C is held rather than raised (it would leave what was
    already sent running, with no handle to cancel it by): the event says one came, and the
    wait that follows cancels the handle at once (:func:`_wait_or_cancel`)."""
    pressed = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def _parse_json_option(text: str, option: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not JSON: {exc}", param_hint=option) from None


def _read_trials(path: Path) -> list[Any]:
    """The trials of a JSON Lines file: one JSON object of kwargs per line (blank lines skipped)."""
    trials = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                trials.append(json.loads(line))
            except ValueError as exc:
                raise click.BadParameter(f"{path}:{number} is not JSON: {exc}", param_hint="--trials") from None
    return trials


def _parse_pack(text: str | None) -> int | str | None:
    """``--pack``: a count or ``auto`` (the sweep's own check names a bad value)."""
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        return text  # refused by sweep() with one line naming it


@click.command(cls=_TakesCommand)
@click.argument("job", required=False)
@_command_options
@click.option("--trials", "trials_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON Lines: one object of the job's kwargs per line, one trial each.")
@click.option("--grid", "grid_text", help='Every combination, e.g. \'{"lr": [0.1, 0.01], "seed": [0, 1, 2]}\'.')
@click.option("--kwargs", "kwargs_text", help="Kwargs every trial shares, as a JSON object.")
@click.option("--devices", default="all", show_default=True, help="all, cpu, gpu, or names: cpu0,gpu0.")
@click.option("--name", help="Name the sweep: the same command with the same name resumes it.")
@click.option("--max-concurrent", type=click.IntRange(1, None),
              help="Trials queued or running at once (default: all; with --group, one per group).")
@click.option("--group", type=click.IntRange(2, 64),
              help="Run each trial over this many DEVICES of one host at once, in one process that sees them "
                   "all (each entry's device: cpu0+cpu1).")
@click.option("--pack", "pack_text", metavar="K|auto",
              help="Train up to K trials as one packed model in one job process ('auto': as many as fit the "
                   "slot's memory); the job must opt in, trials of other shapes run unpacked.")
@click.option("--objective", help="Output field to rank the trials by (and the best so far).")
@click.option("--direction", type=click.Choice(["maximize", "minimize"]), default="maximize", show_default=True)
@click.option("--timeout", type=float, default=SWEEP_TIMEOUT_S, show_default=True, help="Seconds to wait for every trial.")
@click.option("--json", "as_json", is_flag=True, help="Print every trial's entry as JSON.")
@_priority_options
@_require_option
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def sweep(job: str | None, env_pairs: tuple[str, ...], cwd: str | None, trials_file: Path | None,
          grid_text: str | None, kwargs_text: str | None, devices: str, name: str | None,
          max_concurrent: int | None, group: int | None, pack_text: str | None, objective: str | None,
          direction: str, timeout: float, as_json: bool, priority: str, user: str | None,
          require: tuple[str, ...], redis_url: str | None) -> None:
    """Run JOB once per trial over DEVICES, each device taking the next trial when free.

    Prints the trials ranked by --objective (or every entry with --json). Exits 1 if a trial
    failed, 3 if the fleet went away before every trial ended, 130 after Ctrl-C (which cancels
    the sweep).

    Or sweep a program, each trial filling its {placeholders}:
    devicefleet sweep --grid '{"lr": [0.1, 0.01]}' --objective loss -- python train.py --lr {lr}
    """
    if (trials_file is None) == (grid_text is None):
        raise click.UsageError("give exactly one of --trials FILE.jsonl and --grid JSON")
    settings = load_settings(redis_url=redis_url, user=user)
    trials = _read_trials(trials_file) if trials_file else grid(_parse_json_option(grid_text or "", "--grid"))
    app = producer_app(settings)
    with _interrupt_held() as pressed:  # a Ctrl-C before the wait's own handler cancels what was sent
        handle = start_sweep(_job_or_command(job, env_pairs, cwd), trials, devices, name=name,
                             max_concurrent=max_concurrent, priority=priority, group=group,
                             pack=_parse_pack(pack_text), kwargs=_parse_kwargs(kwargs_text),
                             constraints=_constraints(require), app=app)
        if pack_text is not None:
            err_console.print(f"sweep {handle.id}: {handle.packing.reason}")
        watch = (lambda: watch_sweep(handle, err_console, objective=objective, direction=direction,
                                     timeout=timeout)) if err_console.is_terminal else None
        entries, cancelled = _wait_or_cancel(handle, f"sweep {handle.id}", timeout, watch, settings,
                                             pressed)
    if as_json:
        click.echo(json.dumps({"sweep": handle.id, "trials": entries}, indent=2))
    else:
        console.print(ranked_table(sweep_rows(entries, objective), objective, direction))
    raise SystemExit(exit_code(entries, cancelled))


@click.command(cls=_TakesCommand)
@click.argument("job", required=False)
@_command_options
@click.option("--space", "space_text", required=True,
              help='Parameters as JSON: {"lr": {"low": 1e-4, "high": 0.1, "log": true}, "model": ["mlp", "cnn"]} '
                   "(or Optuna's distribution JSON).")
@click.option("--trials", "n_trials", type=click.IntRange(1, None), required=True, help="Trials in the study.")
@click.option("--objective", required=True, help="Output field that is the trial's value.")
@click.option("--direction", type=click.Choice(["maximize", "minimize"]), default="maximize", show_default=True)
@click.option("--pruner", type=click.Choice(["median", "asha", "hyperband", "none"]), default="none", show_default=True,
              help="Stop poor trials early (they report ctx.progress(step=..., value=...)).")
@click.option("--seed", type=int, help="Seed of Optuna's sampler (TPE), for a repeatable study.")
@click.option("--kwargs", "kwargs_text", help="Kwargs every trial shares, as a JSON object.")
@click.option("--devices", default="all", show_default=True, help="all, cpu, gpu, or names: cpu0,gpu0.")
@click.option("--name", help="The study's name in the fleet's Redis: the same name resumes it.")
@click.option("--max-concurrent", type=click.IntRange(1, None),
              help="Trials running at once (default: one per device; with --group, one per group).")
@click.option("--group", type=click.IntRange(2, 64),
              help="Run each trial over this many DEVICES of one host at once, in one process that sees them all.")
@click.option("--pack", "pack_text", metavar="K|auto",
              help="Train up to K trials as one packed model in one job process ('auto': as many as fit the "
                   "slot's memory); the job must opt in; a study that samples a shape param runs unpacked.")
@click.option("--timeout", type=float, help="Seconds to run in all (default: until every trial ends).")
@click.option("--json", "as_json", is_flag=True, help="Print the study's trials and best as JSON.")
@_priority_options
@_require_option
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def optimize(job: str | None, env_pairs: tuple[str, ...], cwd: str | None, space_text: str, n_trials: int, objective: str, direction: str, pruner: str, seed: int | None,
             kwargs_text: str | None, devices: str, name: str | None, max_concurrent: int | None,
             group: int | None, pack_text: str | None, timeout: float | None, as_json: bool, priority: str,
             user: str | None, require: tuple[str, ...], redis_url: str | None) -> None:
    """Tune JOB's parameters with Optuna: each trial runs on the next free device.

    The study lives in the fleet's Redis (Optuna's journal storage); prints the trials ranked by
    the objective. Ctrl-C cancels the running trials (exit 130).

    Or tune a program, each trial filling its {placeholders}:
    devicefleet optimize --space '{"lr": {"low": 0.001, "high": 0.1}}' --trials 20 --objective loss
    --direction minimize -- python train.py --lr {lr}
    """
    settings = load_settings(redis_url=redis_url, user=user)
    view: Any = None
    try:
        optuna = require_optuna()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the live view says what its INFO lines would
        app = producer_app(settings)
        view = StudyView(err_console, objective) if err_console.is_terminal else None
        with _say_on_interrupt("the study's running trials"), (view or contextlib.nullcontext()):
            study = run_study(_job_or_command(job, env_pairs, cwd), _parse_json_option(space_text, "--space"),
                              n_trials, objective,
                              direction=direction, devices=devices, pruner=pruner, name=name,
                              sampler=optuna.samplers.TPESampler(seed=seed) if seed is not None else None,
                              kwargs=_parse_kwargs(kwargs_text), max_concurrent=max_concurrent, group=group,
                              pack=_parse_pack(pack_text), timeout=timeout, on_update=view, priority=priority,
                              constraints=_constraints(require), app=app)
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    rows = study_rows(study)
    if as_json:
        try:
            best: dict[str, Any] | None = {"trial": study.best_trial.number, "value": study.best_value,
                                           "params": study.best_params}
        except ValueError:  # no trial completed
            best = None
        click.echo(json.dumps({"study": study.study_name, "best": best, "trials": rows}, indent=2))
    else:
        console.print(ranked_table(rows, objective, direction))
    raise SystemExit(0 if any(r["status"] == "complete" for r in rows) else 1)
