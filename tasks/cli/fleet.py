"""A fleet's processes on this host: ``up`` (Redis, a worker per device, Flower, the exporter),
``demo`` and ``bench`` (a throwaway fleet), ``exporter`` and ``tensorboard`` on their own."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from ..core.defaults import FLEET_STOP_TIMEOUT_S, RUN_FLEET_STOP_TIMEOUT_S
from ..core.errors import EXIT_CONFIG, DeviceFleetError, FanOutTimeout, FleetError, start_exit_status
from ..core.hiding import environment_secrets, fleet_secrets, hide_from_children
from ..core.records import WorkerRecord
from ..core.registry import live_workers, reading
from ..core.settings import DEFAULT_METRICS_PORT
from ..core.stopflag import StopFlag
from ..ops.exporter import MetricsExporter
from ..ops.fleet import Fleet
from ..ops.status import table as fit_table
from ..ops.tensorboard import DEFAULT_PORT as TENSORBOARD_PORT
from ..ops.tensorboard import command
from ..producer.fanout import fan_out
from .helpers import console, err_console, fail, load_settings
from .results import exit_code, print_results, watch_progress


class _ForceStop(Exception):
    """A second Ctrl-C or SIGTERM while stopping."""


class _StopWhileStarting(Exception):
    """A first Ctrl-C or SIGTERM while ``up`` still starts the fleet."""


@click.command()
@click.option("--cpu-workers", type=click.IntRange(1, 256), help="CPU devices to run (default: 2 on a host with no GPU, else 1).")
@click.option("--gpus", type=click.IntRange(0, 64), help="GPU workers to run (default: one per visible GPU).")
@click.option("--state-dir", type=click.Path(path_type=Path), help="Where Redis data, logs and the fleet file go.")
@click.option("--stop-timeout", type=float, default=FLEET_STOP_TIMEOUT_S, show_default=True, help="Seconds a stopping worker may finish its job.")
@click.option("--flower/--no-flower", default=True, show_default=True, help="Start Flower (loopback, basic auth) with the fleet.")
def up(cpu_workers: int | None, gpus: int | None, state_dir: Path | None, stop_timeout: float, flower: bool) -> None:
    """Start Redis (embedded unless DEVICEFLEET_REDIS_URL is set) and a worker per device.

    Runs in the foreground; Ctrl-C or SIGTERM stops everything (a second one kills at once).
    """
    settings = load_settings(state_dir=state_dir)
    fleet = Fleet(settings, cpu_workers=cpu_workers, gpus=gpus, stop_timeout=stop_timeout, flower=flower)
    stop = StopFlag()  # not threading.Event: its set() in a handler can deadlock (tasks.core.stopflag)
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
        fail(exc, start_exit_status(exc))
    console.print("fleet stopped")


def _live(url: str) -> dict[str, WorkerRecord]:
    with reading(url) as client:
        return live_workers(client)


def _print_status(live: dict[str, WorkerRecord]) -> None:
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


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the result dict as JSON.")
@click.option("--epochs", type=click.IntRange(1, 1000), default=15, show_default=True)
@click.option("--model", type=click.Choice(["mlp", "cnn"]), default="mlp", show_default=True)
@click.option("--cpu-workers", type=click.IntRange(1, 256), help="CPU devices (default: 2 on a host with no GPU, else 1).")
def demo(as_json: bool, epochs: int, model: str, cpu_workers: int | None) -> None:
    """Start a throwaway fleet, train a model on every device at once, print the dict, stop."""
    _interrupt_on_sigterm()
    started = time.perf_counter()
    base = load_settings()
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
            watch_progress(handle, 600)
            results = _get_unless_terminated(handle, 600)
    print_results(results, as_json)
    say(f"demo done in {time.perf_counter() - started:.1f} s")
    raise SystemExit(exit_code(results.values(), cancelled=False))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--quick", is_flag=True, help="Smoke mode (CI): few runs, small batches, short jobs.")
@click.option("--cpu-workers", type=click.IntRange(1, 256), default=2, show_default=True, help="CPU devices of the bench fleet.")
@click.option("--section", "sections", multiple=True, metavar="NAME",
              help="Measure only this section (repeatable): dispatch, producer, sweep, fanout, ddp, gpu, commands, isolation, "
                   "slots, pack, pipeline, groups, scale.")
def bench(as_json: bool, quick: bool, cpu_workers: int, sections: tuple[str, ...]) -> None:
    """Measure a throwaway fleet against what users would do instead; print a table."""
    # Here, not above: the bench loads torch, which `devicefleet --help` (loading this module) must not.
    from ..bench import report
    from ..bench.run import run_bench

    _interrupt_on_sigterm()
    say = err_console.print if as_json else console.print
    say("benchmarking an embedded fleet" + (" (quick)" if quick else "") + "...")
    figures = run_bench(load_settings(), quick=quick, cpu_workers=cpu_workers, sections=list(sections) or None)
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
    deadline = time.monotonic() + timeout
    while True:
        if _terminated.is_set():
            raise KeyboardInterrupt
        try:
            return handle.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except FanOutTimeout:
            if time.monotonic() >= deadline:
                raise


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_METRICS_PORT, show_default=True)
@click.option("--redis-url", help="Broker and backend (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def exporter(port: int, redis_url: str | None) -> None:
    """Serve the fleet's Prometheus metrics on 127.0.0.1:PORT until stopped.

    `devicefleet up` runs this exporter itself; systemd hosts run devicefleet-metrics.service.
    """
    stop = StopFlag()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    settings = load_settings(redis_url=redis_url)
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


@click.command()
@click.option("--logdir", type=click.Path(file_okay=False, path_type=Path),
              help="Event files to show (default: the local fleet's <artifacts>/tensorboard).")
@click.option("--port", type=click.IntRange(1, 65535), default=TENSORBOARD_PORT, show_default=True)
def tensorboard(logdir: Path | None, port: int) -> None:
    """Serve the fleet's loss curves with TensorBoard on 127.0.0.1:PORT until stopped.

    Every `train` run (and every job that calls ctx.log) writes its curves under the artifacts
    directory, one run per fan-out and device. Needs the tensorboard extra.
    """
    logdir = logdir or load_settings().tensorboard_path
    try:
        argv = command(logdir, port)
    except DeviceFleetError as exc:  # TensorBoard is not installed: nothing was started
        fail(exc, EXIT_CONFIG)
    logdir.mkdir(parents=True, exist_ok=True)
    err_console.print(f"TensorBoard on http://127.0.0.1:{port}/ (logs: {logdir}); Ctrl-C stops", highlight=False)
    sys.stderr.flush()
    os.execv(argv[0], argv)  # TensorBoard takes over this process: Ctrl-C and SIGTERM reach it
