"""The ``devicefleet`` command.

Settings precedence: command-line options, then ``DEVICEFLEET_*`` variables, then defaults.
This is the only module that configures logging handlers.

Errors: a devicefleet error that ends a command is one line on stderr, ``Error: ...`` (click's
prefix, which its own usage errors print). Exit statuses (one rule, :func:`tasks.core.errors.exit_status`):
2 (:data:`EXIT_CONFIG`) refused before anything was sent (a bad value on the command line or in
the kwargs, an unknown job or device, a group that cannot form, a command not allowed; click's
usage errors too); 1 (:data:`EXIT_FAILED`) a job failed (or the command failed otherwise); 3
(``EXIT_FLEET_LOST``) the fleet went away under a waiting producer, or there is none to reach.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from .core.defaults import (
    CANCEL_WAIT_S,
    FLEET_STOP_TIMEOUT_S,
    PIPED_OUTPUT_WIDTH,
    RUN_FLEET_STOP_TIMEOUT_S,
    RUN_TIMEOUT_S,
    STATUS_WATCH_INTERVAL_S,
    STOP_MARGIN_S,
    SWEEP_TIMEOUT_S,
)
from .core.errors import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    ConfigError,
    DeviceFleetError,
    FleetError,
    exit_status,
    start_exit_status,
)
from .core.records import DistBackend, Entry, WorkerRecord
from .core.settings import DEFAULT_METRICS_PORT, Settings
from .ops.tensorboard import DEFAULT_PORT as TENSORBOARD_PORT

logger = logging.getLogger(__name__)


def _console(stderr: bool = False) -> Console:
    """A console for stdout (or stderr): rich's layout at the terminal's width on a terminal; on
    a pipe or a file, every line whole (soft wrap, and tables at their natural width up to
    :data:`~tasks.core.defaults.PIPED_OUTPUT_WIDTH`), so a path or an error line in a log can be
    copied and grepped (rich would otherwise wrap at 80 columns), unless ``COLUMNS`` asks for a
    width: then rich's layout at that width, as on a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    if (stream is not None and stream.isatty()) or os.environ.get("COLUMNS"):  # a width asked for: rich's layout
        return Console(stderr=stderr)
    return Console(stderr=stderr, soft_wrap=True, width=PIPED_OUTPUT_WIDTH)


console = _console()
err_console = _console(stderr=True)


#: Before each error line: click's own, so that every error of the command reads the same.
ERROR_PREFIX = "Error:"


def _fail(exc: BaseException, code: int = EXIT_FAILED) -> NoReturn:
    err_console.print(f"[bold red]{ERROR_PREFIX}[/] {escape(str(exc))}", highlight=False, markup=True)
    raise SystemExit(code)


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings.load(**overrides)
    except DeviceFleetError as exc:
        _fail(exc, EXIT_CONFIG)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _ForceStop(Exception):
    """A second Ctrl-C or SIGTERM while stopping."""


class _StopWhileStarting(Exception):
    """A first Ctrl-C or SIGTERM while ``up`` still starts the fleet."""


class _Commands(click.Group):
    """The ``devicefleet`` group: a devicefleet error that ends one of its commands is one line
    (:func:`_fail`), its exit status by :func:`~tasks.core.errors.exit_status`: 2 refused before
    anything was sent, 3 the fleet lost or not there, else 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DeviceFleetError as exc:
            _fail(exc, exit_status(exc))
        except Exception as exc:  # Redis refused a user's credentials or command: one line
            from .core.users import denial

            refused = denial(exc, _credentials_user())
            if refused is None:
                raise
            _fail(refused, exit_status(refused))


def _credentials_user() -> str | None:
    """The user of the credentials this command runs with, if any (for an error's message)."""
    try:
        credentials = Settings.load().user_credentials
    except DeviceFleetError:
        return None
    return credentials.user if credentials is not None else None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="devicefleet")
def cli(verbose: int) -> None:
    """Run one machine-learning job per device (each CPU worker, each GPU) at once."""
    _setup_logging(verbose)


# -- up ----------------------------------------------------------------------------------------


@cli.command()
@click.option("--cpu-workers", type=click.IntRange(1, 256), help="CPU devices to run (default: 2 on a host with no GPU, else 1).")
@click.option("--gpus", type=click.IntRange(0, 64), help="GPU workers to run (default: one per visible GPU).")
@click.option("--state-dir", type=click.Path(path_type=Path), help="Where Redis data, logs and the fleet file go.")
@click.option("--stop-timeout", type=float, default=FLEET_STOP_TIMEOUT_S, show_default=True, help="Seconds a stopping worker may finish its job.")
@click.option("--flower/--no-flower", default=True, show_default=True, help="Start Flower (loopback, basic auth) with the fleet.")
def up(cpu_workers: int | None, gpus: int | None, state_dir: Path | None, stop_timeout: float, flower: bool) -> None:
    """Start Redis (embedded unless DEVICEFLEET_REDIS_URL is set) and a worker per device.

    Runs in the foreground; Ctrl-C or SIGTERM stops everything (a second one kills at once).
    """
    from .ops.fleet import Fleet

    settings = _settings(state_dir=state_dir)
    fleet = Fleet(settings, cpu_workers=cpu_workers, gpus=gpus, stop_timeout=stop_timeout, flower=flower)
    stop = threading.Event()
    starting = True

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise _ForceStop
        console.print(f"\n{signal.Signals(signum).name}: stopping the fleet (again to kill at once)")
        stop.set()
        if starting:
            # Starting waits for every worker to be ready (minutes for a GPU worker that loads
            # CUDA); a stop must not wait for that first.
            raise _StopWhileStarting

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        fleet.start()
        starting = False
        info = fleet.describe()
        console.print(f"[bold green]fleet up[/]: redis {info['redis_url']}, state {info['state_dir']}")
        if info.get("flower_url"):
            where = info.get("flower_auth_file") or "$FLOWER_BASIC_AUTH"
            console.print(f"Flower: {info['flower_url']} (user:password in {where})")
        if info.get("metrics_url"):
            console.print(f"Prometheus metrics: {info['metrics_url']}")
        _print_status(_live(fleet.redis_url))
        console.print("`devicefleet run probe` or `devicefleet status` in another terminal; Ctrl-C to stop.")
        fleet.supervise(stop)
        fleet.stop()
    except _StopWhileStarting:
        fleet.stop()  # a no-op if start() was interrupted: it stopped what it had started
    except _ForceStop:
        fleet.kill()
    except DeviceFleetError as exc:
        fleet.stop()
        _fail(exc, start_exit_status(exc))
    console.print("fleet stopped")


# -- worker ------------------------------------------------------------------------------------


@cli.command()
@click.argument("name")
@click.option("--cores", help="CPU list this worker owns, e.g. 0-3 (default: the config's, else a share).")
@click.option("--redis-url", help="Broker and backend (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
@click.option("--loglevel", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Override the config's log level.")
def worker(name: str, cores: str | None, redis_url: str | None, loglevel: str | None) -> None:
    """Run the worker that owns device NAME (cpu0, gpu1...) in the foreground."""
    from .core.app import create_app
    from .core.devices import host_name
    from .core.worker_config import load_worker_config
    from .ops import celery_main

    # Validated here, at the edge, and handed to the worker's app: the worker's steps read
    # these settings, never the environment again.
    settings = _settings(cores=cores, redis_url=redis_url)
    try:
        device = settings.device(name)
        config = load_worker_config(settings.worker_configs_path, device)
        settings = settings.model_copy(update={"redis_url": settings.resolve_redis_url()})
    except DeviceFleetError as exc:  # all of it the worker's settings: restarting cannot help
        _fail(exc, EXIT_CONFIG)
    argv = [
        "worker",
        # Multi-host names (cpu0@hosta) are already the node name.
        "--hostname", device.name if device.host else f"{device.name}@{host_name()}",
        "--pool", config.pool.value,
        # One job per slot (the jobs step sets the same from the config for `celery -A tasks worker`).
        "--concurrency", str(config.slots),
        "--task-events",
        "--loglevel", loglevel or config.loglevel,
        # No start-up round trips to other workers: a device worker needs nothing from them.
        "--without-mingle",
        "--without-gossip",
    ]
    # The device's own queues, visibility, cores and jobs are the worker steps' (tasks.worker).
    # With the worker's exit status, which app.worker_main() drops: a worker that could not
    # start (Redis refused its registration) exits 1 and systemd's Restart=on-failure restarts it.
    raise SystemExit(celery_main.run(create_app(settings), argv))


# -- run / status / demo -----------------------------------------------------------------------


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
    from .core.priority import DEFAULT_LEVEL, Level

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
    from .core.placement import parse_requirements

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
    from .producer.commands import command

    try:
        return command(argv, cwd=cwd, env=env)
    except DeviceFleetError as exc:
        _fail(exc, EXIT_CONFIG)


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


@cli.command(cls=_TakesCommand)
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
    from .producer.fanout import fan_out

    target = _job_or_command(job, env_pairs, cwd)
    is_command = not isinstance(target, str)
    if is_command and kwargs_text:
        raise click.UsageError("--kwargs goes with a JOB; give a command's arguments after --")
    kwargs = _parse_kwargs(kwargs_text) if not is_command else None
    settings = _settings(redis_url=redis_url, user=user)
    given = {"backend": backend, "max_restarts": max_restarts, "join_timeout_s": join_timeout}
    gang: dict[str, Any] | bool = {k: v for k, v in given.items() if v is not None} if distributed else False
    if not distributed and any(v is not None for v in given.values()):
        raise click.UsageError("--backend, --max-restarts and --join-timeout go with --distributed")
    app = _producer_app(settings)
    options = {"fallback": fallback, "time_limit_s": time_limit, "max_attempts": max_attempts}
    with _interrupt_held() as pressed:  # a Ctrl-C before the wait's own handler cancels what was sent
        handle = fan_out(target, devices, kwargs=kwargs,
                         options={k: v for k, v in options.items() if v is not None} or None,
                         distributed=gang, per_slot=per_slot, group=group, priority=priority,
                         constraints=_constraints(require), app=app)
        if is_command:
            watch: Callable[[], None] | None = lambda: _print_logs(handle, timeout, as_json)  # noqa: E731
        else:
            watch = (lambda: _watch_progress(handle, timeout)) if progress else None
        results, cancelled = _wait_or_cancel(handle, "the fan-out", timeout, watch, settings, pressed)
    _print_results(results, as_json)
    raise SystemExit(_exit_code(results.values(), cancelled))


def _producer_app(settings: Settings) -> Any:
    """The command's producer app, closed with its connections when the command ends (click's
    context closes on every exit: a result, an error, ``SystemExit``), not left to the garbage
    collector: the CLI also runs in process (``CliRunner``, a script calling ``cli.main``)."""
    from .core.app import create_app

    app = create_app(settings.model_copy(update={"redis_url": settings.resolve_redis_url()}))
    click.get_current_context().call_on_close(app.close)
    return app


def _exit_code(entries: Iterable[Mapping[str, Any]], cancelled: bool) -> int:
    """130 after Ctrl-C, 1 if a job failed, else 0."""
    if cancelled:
        return EXIT_INTERRUPTED
    return 0 if all(Entry.parse(entry).ok for entry in entries) else EXIT_FAILED


def _wait_or_cancel(handle: Any, what: str, timeout: float, watch: Callable[[], None] | None,
                    settings: Settings, interrupted: threading.Event | None = None) -> tuple[Any, bool]:
    """``(handle.get(timeout), False)``, after ``watch()`` draws it; on Ctrl-C (or ``interrupted``
    set: one came before this wait's handler, :func:`_interrupt_held`), says so, cancels the
    handle and returns ``(what it collected, True)``.

    Raises:
        FleetLost: the fleet went away meanwhile (:mod:`tasks.ops.fleet_lost`).
    """
    from .ops.fleet_lost import watching_the_fleet

    # The handler that raises lives only inside the try: a Ctrl-C that came while the fleet's
    # watch was being set up, or between the handler's install and the try, raised outside it
    # before, and the command ended as click's "Aborted!" (exit 1) with the jobs still running.
    with watching_the_fleet(settings, what):
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


@cli.command(cls=_TakesCommand)
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
    from .ops.sweep_view import ranked_table, sweep_rows, watch_sweep
    from .producer.sweep import grid
    from .producer.sweep import sweep as start_sweep

    if (trials_file is None) == (grid_text is None):
        raise click.UsageError("give exactly one of --trials FILE.jsonl and --grid JSON")
    settings = _settings(redis_url=redis_url, user=user)
    trials = _read_trials(trials_file) if trials_file else grid(_parse_json_option(grid_text or "", "--grid"))
    app = _producer_app(settings)
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
    raise SystemExit(_exit_code(entries, cancelled))


@cli.command(cls=_TakesCommand)
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
    from .ops.sweep_view import StudyView, ranked_table, study_rows
    from .producer.optimize import optimize as run_study
    from .producer.optimize import require_optuna

    settings = _settings(redis_url=redis_url, user=user)
    view: Any = None
    try:
        optuna = require_optuna()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the live view says what its INFO lines would
        app = _producer_app(settings)
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


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the fleet as JSON.")
@click.option("--watch", is_flag=True,
              help="Refresh in place until Ctrl-C (into a file or a pipe: a new frame every interval).")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=STATUS_WATCH_INTERVAL_S, show_default=True, help="Seconds between refreshes with --watch.")
@click.option("--url", "print_url", is_flag=True,
              help="Print only the fleet's Redis URL, password included (for a client of your own), and exit.")
@click.option("--redis-url", help="Fleet to show (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def status(as_json: bool, watch: bool, interval: float, print_url: bool, redis_url: str | None) -> None:
    """Show the live fleet: each device's worker, busy or idle, throughput, queue depths.

    Everywhere else the password is masked (redis://:***@...); --url prints the URL whole,
    e.g. for plain Celery: export DEVICEFLEET_REDIS_URL="$(devicefleet status --url)".
    """
    from .core.settings import read_fleet_file
    from .ops.status import render, report

    settings = _settings(redis_url=redis_url)
    url = settings.resolve_redis_url()
    if print_url:
        if as_json or watch:
            raise click.UsageError("--url prints the URL alone: it goes without --json and --watch")
        click.echo(url)
        return
    info = read_fleet_file(settings.fleet_file)
    rep = report(url, info)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    elif not watch:
        console.print(render(rep))
    elif not console.is_terminal:
        _watch_frames(lambda: render(report(url, info)), render(rep), interval)
    else:
        from rich.live import Live

        # Ctrl-C sets an event the loop waits on, rather than raising KeyboardInterrupt wherever
        # the main thread happens to be (inside a Redis read, or inside rich's Live with its
        # refresh thread): a Ctrl-C there could leave `status --watch` running, and CI saw one
        # that did not exit.
        stop = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
        try:
            with Live(render(rep), console=console, refresh_per_second=4) as live:
                while not stop.wait(interval):
                    try:
                        frame: Any = render(report(url, info))
                    except DeviceFleetError as exc:
                        frame = f"[red]{exc}[/]"
                    if not stop.is_set():
                        live.update(frame)
        finally:
            signal.signal(signal.SIGINT, previous)


# -- devicefleet device drain | undrain | list (issue 50; the logic: tasks/ops/devices_admin.py) ---


@cli.group()
def device() -> None:
    """Take a device out of service and back (drain, undrain), or list the devices' states."""


@device.command("drain")
@click.argument("name")
@click.option("--reason", required=True, help="Why (shown by `device list` and `status`).")
@click.option("--now", is_flag=True, help="Hand its running jobs back to their queue now instead of letting them finish.")
@click.option("--redis-url", help="Fleet (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def device_drain(name: str, reason: str, now: bool, redis_url: str | None) -> None:
    """Take device NAME out of service: it takes no new job, keeps its heartbeat; fan-outs skip it."""
    from .core.errors import UnknownDevice
    from .core.registry import reading
    from .ops.devices_admin import drain

    settings = _settings(redis_url=redis_url)
    url = settings.resolve_redis_url()
    with reading(url) as client:
        try:
            state = drain(client, name, reason, now=now, replication=settings.replication(url))
        except UnknownDevice as exc:
            _fail(exc, EXIT_CONFIG)
    click.echo(f"{name} drained by {state.by}: {reason}" + (" (running jobs handed back)" if now else ""))


@device.command("undrain")
@click.argument("name")
@click.option("--redis-url", help="Fleet (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def device_undrain(name: str, redis_url: str | None) -> None:
    """Put device NAME back in service (after a probe job, if it was drained for a hardware error)."""
    from .core.errors import UnknownDevice
    from .core.registry import reading
    from .ops.devices_admin import undrain

    settings = _settings(redis_url=redis_url)
    url = settings.resolve_redis_url()
    with reading(url) as client:
        try:
            state = undrain(client, name, app=_producer_app(settings), replication=settings.replication(url))
        except UnknownDevice as exc:
            _fail(exc, EXIT_CONFIG)
    if not state.in_service:
        _fail(FleetError(f"{name} stays {state.state}: {state.reason}"))
    click.echo(f"{name} is back in service")


@device.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the devices as JSON.")
@click.option("--redis-url", help="Fleet (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def device_list(as_json: bool, redis_url: str | None) -> None:
    """Every known device's service state: ok, drained, quarantined or suspect, why, since, by whom."""
    from .core.registry import reading
    from .ops.devices_admin import listing
    from .ops.status import table as fit_table

    with reading(_settings(redis_url=redis_url).resolve_redis_url()) as client:
        rows = listing(client)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = fit_table(f"{len(rows)} device(s)", ["device", "live", "state", "reason", "since", "by"])
    for row in rows:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["since"])) if row["since"] else ""
        table.add_row(row["device"], "yes" if row["live"] else "no", row["state"], row["reason"], since, row["by"])
    console.print(table)


def _watch_frames(frame: Callable[[], Any], first: Any, interval: float) -> None:
    """``status --watch`` off a terminal (a file, a pipe): a frame every ``interval`` seconds,
    each after a line with the time, flushed as it is printed (as ``watch``-like tools do);
    until Ctrl-C or SIGTERM (a reader that went away, as ``| head`` does: rich's console exits
    quietly)."""
    shown = first
    try:
        while True:
            console.print(f"-- {time.strftime('%Y-%m-%d %H:%M:%S')}", highlight=False)
            console.print(shown)
            sys.stdout.flush()
            time.sleep(interval)
            try:
                shown = frame()
            except DeviceFleetError as exc:
                shown = f"{ERROR_PREFIX} {escape(str(exc))}"
    except KeyboardInterrupt:
        pass


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the result dict as JSON.")
@click.option("--epochs", type=click.IntRange(1, 1000), default=15, show_default=True)
@click.option("--model", type=click.Choice(["mlp", "cnn"]), default="mlp", show_default=True)
@click.option("--cpu-workers", type=click.IntRange(1, 256), help="CPU devices (default: 2 on a host with no GPU, else 1).")
def demo(as_json: bool, epochs: int, model: str, cpu_workers: int | None) -> None:
    """Start a throwaway fleet, train a model on every device at once, print the dict, stop."""
    from .ops.fleet import Fleet
    from .producer.fanout import fan_out

    _interrupt_on_sigterm()
    started = time.perf_counter()
    base = _settings()
    with tempfile.TemporaryDirectory(prefix="devicefleet-demo-") as tmp:
        settings = base.model_copy(update={
            "redis_url": None, "state_dir": Path(tmp), "artifacts_dir": base.artifacts_path,
        })
        say = err_console.print if as_json else console.print
        say("starting an embedded fleet (redis-server + one worker per device)...")
        with Fleet(settings, cpu_workers=cpu_workers, stop_timeout=RUN_FLEET_STOP_TIMEOUT_S).start() as fleet:
            devices = list(fleet.workers)
            say(f"fleet ready in {time.perf_counter() - started:.1f} s: {', '.join(devices)}; "
                f"training {model} on digits for {epochs} epochs on each")
            handle = fan_out("train", "all", kwargs={"model": model, "epochs": epochs},
                             app=fleet.app())
            _watch_progress(handle, 600)
            results = _get_unless_terminated(handle, 600)
    _print_results(results, as_json)
    say(f"demo done in {time.perf_counter() - started:.1f} s")
    raise SystemExit(_exit_code(results.values(), cancelled=False))


# -- deploy ------------------------------------------------------------------------------------


@cli.command()
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("/"), show_default=True,
              help="Write the files under this folder (for review) instead of the system.")
@click.option("--gpus", type=click.IntRange(0, 64), help="GPU workers to render (default: one per GPU torch sees).")
@click.option("--cpu-workers", type=click.IntRange(1, 256), default=1, show_default=True)
@click.option("--join", "join_url", metavar="URL", help="Join another host's Redis (rediss://...) instead of running one.")
@click.option("--serve", "serve_address", metavar="ADDRESS", help="Run Redis for other hosts too, with TLS on ADDRESS.")
@click.option("--sentinel", "sentinel_hosts", metavar="ADDR1,ADDR2,ADDR3",
              help="Redis Sentinel on these hosts (no TLS: a private network); this host is ADDR1, the first "
                   "primary. Prints the --join command of the others.")
@click.option("--this-host", metavar="ADDRESS",
              help="With --join sentinel://...: run this host's Redis (a replica) and sentinel on ADDRESS.")
@click.option("--device-names", type=click.Choice(["short", "host"]), help="Default: host with --join/--serve, else short.")
@click.option("--state-dir", type=click.Path(path_type=Path), default=Path("/var/lib/devicefleet"), show_default=True)
@click.option("--stop-margin", type=click.IntRange(0, 86_400), default=STOP_MARGIN_S, show_default=True,
              help="Seconds of stop timeout beyond each worker's max_job_seconds.")
@click.option("--bin", "devicefleet_bin", type=click.Path(dir_okay=False, path_type=Path),
              help="The devicefleet executable the units run (default: this one).")
@click.option("--job-account", "job_users", metavar="USER", multiple=True,
              help="Run this fleet user's jobs as a system account of their own, <unit user>-USER, with a folder "
                   "only it opens (repeatable; the guide: Users).")
def deploy(root: Path, gpus: int | None, cpu_workers: int, join_url: str | None, serve_address: str | None,
           sentinel_hosts: str | None, this_host: str | None, device_names: str | None, state_dir: Path,
           stop_margin: int, devicefleet_bin: Path | None, job_users: tuple[str, ...]) -> None:
    """Render systemd units and configs for this host's devices; print the commands to enable them."""
    from .core.devices import DeviceNames
    from .ops.deploy import join_commands, plan_host, render

    try:
        plan = plan_host(
            gpus=gpus, cpu_workers=cpu_workers, join_url=join_url, serve_address=serve_address,
            sentinel_hosts=sentinel_hosts.split(",") if sentinel_hosts is not None else None, this_host=this_host,
            device_names=DeviceNames(device_names) if device_names else None, root=root,
            devicefleet_bin=devicefleet_bin, state_dir=state_dir, stop_margin_s=stop_margin, job_users=job_users,
        )
        done = render(plan, root)
    except DeviceFleetError as exc:  # the options, checked before anything is written
        _fail(exc, EXIT_CONFIG)
    for path in done.files:
        console.print(f"wrote {root / path.relative_to(path.anchor)}", highlight=False, soft_wrap=True)
    for path in done.kept:
        console.print(f"kept  {root / path.relative_to(path.anchor)} (already there)", highlight=False, soft_wrap=True)
    console.print(f"workers: {', '.join(plan.devices)}; then, as root:", highlight=False)
    for line in done.commands:
        click.echo(f"  {line}")
    for host, command in join_commands(plan).items():
        console.print(f"then on {host}, as root (the URL holds both passwords):", highlight=False)
        click.echo(f"  {command}")


# -- exporter ----------------------------------------------------------------------------------


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_METRICS_PORT, show_default=True)
@click.option("--redis-url", help="Broker and backend (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def exporter(port: int, redis_url: str | None) -> None:
    """Serve the fleet's Prometheus metrics on 127.0.0.1:PORT until stopped.

    `devicefleet up` runs this exporter itself; systemd hosts run devicefleet-metrics.service.
    """
    from .core.hiding import environment_secrets, fleet_secrets, hide_from_children
    from .ops.exporter import MetricsExporter

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    settings = _settings(redis_url=redis_url)
    try:
        url = settings.resolve_redis_url()
        # The URL opens the fleet: closed to the jobs of this user (tasks.core.hiding).
        hide_from_children([*fleet_secrets(url), *environment_secrets()])
        served = MetricsExporter(url, port=port).start()
    except OSError as exc:
        raise FleetError(f"cannot serve metrics on 127.0.0.1:{port}: {exc}") from None
    console.print(f"serving {served.url}; Ctrl-C or SIGTERM stops", highlight=False)
    stop.wait()
    served.stop()


# -- cap, usage (tasks.core.caps, tasks.ops.usage) ----------------------------------------------


@cli.group()
def cap() -> None:
    """Caps on the devices of each kind a user or team holds at once (fleet-wide, live)."""


def _cap_client(redis_url: str | None) -> Any:
    from .core.registry import reading

    return reading(_settings(redis_url=redis_url).resolve_redis_url())


@cap.command("set")
@click.argument("args", nargs=-1, required=True, metavar="[USER] KIND=DEVICES...")
@click.option("--team", help="Cap this team (named with `devicefleet cap team`) instead of a user.")
@click.option("--borrow/--no-borrow", default=False, show_default=True,
              help="Over the cap, run on devices no one else wants, as preemptible work.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_set(args: tuple[str, ...], team: str | None, borrow: bool, redis_url: str | None) -> None:
    """Set USER's (or --team's) cap, e.g. `devicefleet cap set alice gpu=4 --borrow`."""
    from .core.caps import parse_limits, set_cap

    user, items = (None, list(args)) if team is not None else (args[0], list(args[1:]))
    try:
        limits = parse_limits(items)
    except DeviceFleetError as exc:  # refused before anything is written
        _fail(exc, EXIT_CONFIG)
    with _cap_client(redis_url) as client:
        set_cap(client, limits, user=user, team=team, borrow=borrow)
    name = f"team {team}" if team is not None else user
    for kind, limit in limits.items():
        click.echo(f"{name}: at most {limit} {kind} at once, borrowing {'on' if borrow else 'off'}")


@cap.command("team")
@click.argument("team")
@click.argument("users", nargs=-1, required=True)
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_team(team: str, users: tuple[str, ...], redis_url: str | None) -> None:
    """Name TEAM's USERS (a team's cap counts their devices together)."""
    from .core.caps import set_team

    with _cap_client(redis_url) as client:
        cap_record = set_team(client, team, list(users))
    click.echo(f"team {team}: {', '.join(cap_record.members or [])}")


@cap.command("remove")
@click.argument("user", required=False)
@click.option("--team", help="Remove this team and its cap instead.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_remove(user: str | None, team: str | None, redis_url: str | None) -> None:
    """Remove USER's cap (or --team with its cap)."""
    from .core.caps import remove_cap

    with _cap_client(redis_url) as client:
        remove_cap(client, user=user, team=team)


@cap.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the caps and what each holds as JSON.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_list(as_json: bool, redis_url: str | None) -> None:
    """Each cap and what it holds now: `alice: 4/4 gpu (cap), borrowing off`."""
    from .core.caps import read_cap_uses

    with _cap_client(redis_url) as client:
        caps, uses = read_cap_uses(client)
    if as_json:
        click.echo(json.dumps({"caps": {subject: c.to_dict() for subject, c in caps.items()},
                               "held": [{"subject": u.subject, "kind": u.kind, "held": u.held, "limit": u.limit,
                                         "borrow": u.borrow, "line": u.line()} for u in uses]}, indent=2))
        return
    for use in uses:
        click.echo(use.line())
    for subject, c in caps.items():
        if c.members is not None:
            click.echo(f"team {subject.removeprefix('team:')}: {', '.join(c.members)}")
    if not caps:
        click.echo("no caps set (devicefleet cap set USER KIND=DEVICES)")


@cli.command()
@click.option("--since", default=None, metavar="AGE", help="Only the last AGE, e.g. 7d, 12h (default: ever).")
@click.option("--json", "as_json", is_flag=True, help="Print each row as JSON.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def usage(since: str | None, as_json: bool, redis_url: str | None) -> None:
    """Per user and team: device-hours held, the device's busy fraction while held, held idle."""
    from .ops.usage import parse_since, read_fleet_usage, usage_lines

    try:
        since_s = parse_since(since) if since is not None else None
    except DeviceFleetError as exc:
        _fail(exc, EXIT_CONFIG)
    with _cap_client(redis_url) as client:
        rows = read_fleet_usage(client, since_s)
    if as_json:
        click.echo(json.dumps([row.to_dict() for row in rows], indent=2))
        return
    for line in usage_lines(rows) or ["no jobs counted" + (f" in the last {since}" if since else "")]:
        click.echo(line)


# -- tensorboard -------------------------------------------------------------------------------


@cli.command()
@click.option("--logdir", type=click.Path(file_okay=False, path_type=Path),
              help="Event files to show (default: the local fleet's <artifacts>/tensorboard).")
@click.option("--port", type=click.IntRange(1, 65535), default=TENSORBOARD_PORT, show_default=True)
def tensorboard(logdir: Path | None, port: int) -> None:
    """Serve the fleet's loss curves with TensorBoard on 127.0.0.1:PORT until stopped.

    Every `train` run (and every job that calls ctx.log) writes its curves under the artifacts
    directory, one run per fan-out and device. Needs the tensorboard extra.
    """
    from .ops.tensorboard import command

    logdir = logdir or _settings().tensorboard_path
    try:
        argv = command(logdir, port)
    except DeviceFleetError as exc:  # TensorBoard is not installed: nothing was started
        _fail(exc, EXIT_CONFIG)
    logdir.mkdir(parents=True, exist_ok=True)
    err_console.print(f"TensorBoard on http://127.0.0.1:{port}/ (logs: {logdir}); Ctrl-C stops", highlight=False)
    sys.stderr.flush()
    os.execv(argv[0], argv)  # TensorBoard takes over this process: Ctrl-C and SIGTERM reach it


# -- users (issue 49: tasks.ops.users) -----------------------------------------------------------


@cli.group()
def user() -> None:
    """The fleet's users, each with credentials of their own (run by the fleet's admin)."""


@user.command("add")
@click.argument("name")
@click.option("--team", default=None, help="The team (a named set of users) the user is in.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the credentials file (mode 0600). Default: ./credentials-NAME.json.")
def user_add(name: str, team: str | None, output: Path | None) -> None:
    """Add user NAME (new credentials if NAME exists: the old ones stop working)."""
    from .core.registry import connect
    from .ops.users import add_user

    settings = _settings()
    output = output or Path(f"credentials-{name}.json")
    url = settings.resolve_redis_url()
    client = connect(url)
    try:
        credentials = add_user(client, url, name, team=team, output=output)
    finally:
        client.close()
    console.print(f"added user {credentials.user}" + (f" (team {team})" if team else "")
                  + f"; credentials in {output} (mode 0600). Give them the file: their producer finds it at "
                  f"~/.config/devicefleet/credentials.json, or with DEVICEFLEET_CREDENTIALS=<file>.", highlight=False)


@user.command("remove")
@click.argument("name")
def user_remove(name: str) -> None:
    """Remove user NAME: their credentials stop working at once."""
    from .core.registry import connect
    from .ops.users import remove_user

    url = _settings().resolve_redis_url()
    client = connect(url)
    try:
        removed = remove_user(client, name, url)
    finally:
        client.close()
    if not removed:
        _fail(ConfigError(f"no user {name!r} on this fleet: `devicefleet user list` shows who is"), EXIT_CONFIG)
    console.print(f"removed user {name}", highlight=False)


@user.command("list")
def user_list() -> None:
    """The fleet's users: name, team, when added."""
    from .core.registry import connect
    from .ops.users import list_users

    client = connect(_settings().resolve_redis_url())
    try:
        users = list_users(client)
    finally:
        client.close()
    if not users:
        console.print("no users: every job is sent with the fleet's own password (`devicefleet user add NAME`)",
                      highlight=False)
    for info in users:
        added = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.added_at))
        state = "" if info.acl_user else "  (no Redis user: `devicefleet user add` it again)"
        console.print(f"{info.user}\tteam={info.team or '-'}\tadded {added} UTC{state}", highlight=False)


# -- bench -------------------------------------------------------------------------------------


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--quick", is_flag=True, help="Smoke mode (CI): few runs, small batches, short jobs.")
@click.option("--cpu-workers", type=click.IntRange(1, 256), default=2, show_default=True, help="CPU devices of the bench fleet.")
@click.option("--section", "sections", multiple=True, metavar="NAME",
              help="Measure only this section (repeatable): dispatch, producer, sweep, fanout, ddp, gpu, commands, isolation, "
                   "slots, pack, pipeline, groups, scale.")
def bench(as_json: bool, quick: bool, cpu_workers: int, sections: tuple[str, ...]) -> None:
    """Measure a throwaway fleet against what users would do instead; print a table."""
    from .bench import report
    from .bench.run import run_bench

    _interrupt_on_sigterm()
    say = err_console.print if as_json else console.print
    say("benchmarking an embedded fleet" + (" (quick)" if quick else "") + "...")
    figures = run_bench(_settings(), quick=quick, cpu_workers=cpu_workers, sections=list(sections) or None)
    if as_json:
        click.echo(json.dumps(figures, indent=2, default=str))
    else:
        console.print(report.table(figures))
        say(f"bench done in {figures['elapsed_s']:.0f} s")


#: Set once SIGTERM arrived. Python swallows an exception that a signal handler raises while a
#: finalizer runs ("Exception ignored in: <function ConnectionPool.__del__>"), so the demo's
#: wait also checks this, or a SIGTERM could be lost and the fleet orphaned.
_terminated = threading.Event()


def _interrupt_on_sigterm() -> None:
    """SIGTERM acts as Ctrl-C, so a throwaway fleet (demo, bench) is stopped, not orphaned."""
    def terminated(signum: int, frame: Any) -> None:
        _terminated.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)


def _get_unless_terminated(handle: Any, timeout: float) -> Any:
    """``handle.get(timeout)``, in one-second waits that raise KeyboardInterrupt once SIGTERM has
    arrived (even if the handler's own KeyboardInterrupt was swallowed)."""
    from .core.errors import FanOutTimeout

    deadline = time.monotonic() + timeout
    while True:
        if _terminated.is_set():
            raise KeyboardInterrupt
        try:
            return handle.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except FanOutTimeout:
            if time.monotonic() >= deadline:
                raise


# -- output ------------------------------------------------------------------------------------


def _print_logs(handle: Any, timeout: float, as_json: bool) -> None:
    """Each command's lines as they come, after their device: stdout's on stdout, stderr's on
    stderr (both on stderr with ``--json``, whose stdout is one JSON document)."""
    from .ops.log_view import print_logs

    print_logs(handle, timeout, sys.stderr if as_json else sys.stdout, sys.stderr)


def _watch_progress(handle: Any, timeout: float) -> None:
    """Live progress bars on stderr while ``handle`` runs (only on a terminal)."""
    from .ops.progress_view import watch

    if err_console.is_terminal:
        watch(handle, err_console, timeout=timeout)


def _live(url: str) -> dict[str, WorkerRecord]:
    from .core.registry import live_workers, reading

    with reading(url) as client:
        return live_workers(client)


def _print_status(live: dict[str, WorkerRecord]) -> None:
    from .ops.status import table as fit_table

    table = fit_table(f"{len(live)} live device(s)",
                      ["device", "worker", "pid", "state", "jobs", "CUDA visible", "sees", "cores"])
    now = time.time()
    for device, rec in live.items():
        busy = rec.busy
        state = f"busy: {busy.job} {now - busy.since:.0f}s" if busy else ("idle" if rec.ready else "starting")
        if rec.slot_count > 1:
            state += f" ({len(rec.running)}/{rec.slot_count} slots busy)"
        table.add_row(
            device, rec.worker, str(rec.pid), state, str(rec.jobs_done), str(rec.cuda_visible_devices),
            f"{rec.device_name}" + (" (CUDA)" if rec.cuda_available else ""),
            ",".join(str(c) for c in rec.cores),
        )
    console.print(table)
    # What a worker found wrong in its [commands] when it started (it logged them too): said
    # where the user looks, not only in the worker's log.
    for device, rec in live.items():
        for problem in rec.commands.problems(device) if rec.commands is not None else []:
            err_console.print(f"[yellow]Warning:[/] {escape(problem)}", highlight=False)


def _print_results(results: dict[str, dict[str, Any]], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    from .ops.result_table import fanout_table

    table, below = fanout_table(results)
    console.print(table)
    for line in below:
        console.print(line, highlight=False, soft_wrap=True)


def main() -> None:
    cli(standalone_mode=True)


if __name__ == "__main__":
    main()
