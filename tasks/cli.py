"""The ``devicefleet`` command.

Settings precedence: command-line options, then ``DEVICEFLEET_*`` variables, then defaults.
This is the only module that configures logging handlers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from .errors import DeviceFleetError
from .settings import Settings, redact_url

logger = logging.getLogger(__name__)
console = Console()
err_console = Console(stderr=True)


def _fail(exc: BaseException, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True)
    raise SystemExit(code)


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings.load(**overrides)
    except DeviceFleetError as exc:
        _fail(exc, 2)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _ForceStop(Exception):
    """A second Ctrl-C or SIGTERM while stopping."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("--stop-timeout", type=float, default=60.0, show_default=True, help="Seconds a stopping worker may finish its job.")
def up(cpu_workers: int | None, gpus: int | None, state_dir: Path | None, stop_timeout: float) -> None:
    """Start Redis (embedded unless DEVICEFLEET_REDIS_URL is set) and a worker per device.

    Runs in the foreground; Ctrl-C or SIGTERM stops everything (a second one kills at once).
    """
    from .fleet import Fleet

    settings = _settings(state_dir=state_dir)
    fleet = Fleet(settings, cpu_workers=cpu_workers, gpus=gpus, stop_timeout=stop_timeout)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise _ForceStop
        console.print(f"\n{signal.Signals(signum).name}: stopping the fleet (again to kill at once)")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        fleet.start()
    except DeviceFleetError as exc:
        _fail(exc)
    info = fleet.describe()
    console.print(f"[bold green]fleet up[/]: redis {info['redis_url']}, state {info['state_dir']}")
    _print_status(_live(fleet.redis_url))
    console.print("`devicefleet run probe` or `devicefleet status` in another terminal; Ctrl-C to stop.")
    try:
        fleet.supervise(stop)
        fleet.stop()
    except _ForceStop:
        fleet.kill()
    console.print("fleet stopped")


# -- worker ------------------------------------------------------------------------------------


@cli.command()
@click.argument("name")
@click.option("--cores", help="CPU list this worker owns, e.g. 0-3 (default: the config's, else a share).")
@click.option("--redis-url", help="Broker and backend (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
@click.option("--loglevel", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Override the config's log level.")
def worker(name: str, cores: str | None, redis_url: str | None, loglevel: str | None) -> None:
    """Run the worker that owns device NAME (cpu0, gpu1...) in the foreground."""
    from .devices import Device, apply_visibility
    from .worker_config import load_worker_config

    # Options become environment so Celery's signal handlers read the same settings.
    for key, value in (("DEVICEFLEET_CORES", cores), ("DEVICEFLEET_REDIS_URL", redis_url)):
        if value:
            os.environ[key] = value
    settings = _settings()
    try:
        device = Device.parse(name)
        config = load_worker_config(settings.worker_configs_path, device)
        settings.resolve_redis_url()
        apply_visibility(device)  # before anything imports torch
    except DeviceFleetError as exc:
        _fail(exc, 2)
    from .celery_app import app
    from .devices import host_name
    from .queues import worker_queues

    argv = [
        "worker",
        "--hostname", f"{device.name}@{host_name()}",
        "--pool", config.pool.value,
        "--concurrency", str(config.concurrency),
        "--queues", ",".join(worker_queues(device, config.extra_queues)),
        "--task-events",
        "--loglevel", loglevel or config.loglevel,
        # No start-up round trips to other workers: a device worker needs nothing from them.
        "--without-mingle",
        "--without-gossip",
    ]
    app.worker_main(argv)


# -- run / status / demo -----------------------------------------------------------------------


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


@cli.command()
@click.argument("job")
@click.option("--kwargs", "kwargs_text", help='Job kwargs as a JSON object, e.g. \'{"epochs": 5}\'.')
@click.option("--devices", default="all", show_default=True, help="all, cpu, gpu, or names: cpu0,gpu0.")
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="Seconds to wait for every device.")
@click.option("--json", "as_json", is_flag=True, help="Print the result dict as JSON.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def run(job: str, kwargs_text: str | None, devices: str, timeout: float, as_json: bool, redis_url: str | None) -> None:
    """Fan JOB out to DEVICES and print {device: entry}. Exits 1 if any device failed."""
    from .celery_app import create_app
    from .fanout import fan_out

    kwargs = _parse_kwargs(kwargs_text)
    settings = _settings(redis_url=redis_url)
    try:
        app = create_app(settings.model_copy(update={"redis_url": settings.resolve_redis_url()}))
        results = fan_out(job, devices, kwargs=kwargs, app=app).get(timeout=timeout)
    except DeviceFleetError as exc:
        _fail(exc)
    _print_results(results, as_json)
    raise SystemExit(0 if all(e["status"] == "ok" for e in results.values()) else 1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the fleet as JSON.")
@click.option("--redis-url", help="Fleet to show (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def status(as_json: bool, redis_url: str | None) -> None:
    """Show the live fleet: each device's worker, what it sees, and what it runs."""
    settings = _settings(redis_url=redis_url)
    try:
        url = settings.resolve_redis_url()
        live = _live(url)
    except DeviceFleetError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps({"redis_url": redact_url(url), "workers": live}, indent=2))
    else:
        _print_status(live)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the result dict as JSON.")
@click.option("--epochs", type=click.IntRange(1, 1000), default=15, show_default=True)
@click.option("--model", type=click.Choice(["mlp", "cnn"]), default="mlp", show_default=True)
@click.option("--cpu-workers", type=click.IntRange(1, 256), help="CPU devices (default: 2 on a host with no GPU, else 1).")
def demo(as_json: bool, epochs: int, model: str, cpu_workers: int | None) -> None:
    """Start a throwaway fleet, train a model on every device at once, print the dict, stop."""
    from .fanout import fan_out
    from .fleet import Fleet

    started = time.perf_counter()
    base = _settings()
    with tempfile.TemporaryDirectory(prefix="devicefleet-demo-") as tmp:
        settings = base.model_copy(update={
            "redis_url": None, "state_dir": Path(tmp), "artifacts_dir": base.artifacts_path,
        })
        say = err_console.print if as_json else console.print
        say("starting an embedded fleet (redis-server + one worker per device)...")
        try:
            with Fleet(settings, cpu_workers=cpu_workers, stop_timeout=30).start() as fleet:
                devices = list(fleet.workers)
                say(f"fleet ready in {time.perf_counter() - started:.1f} s: {', '.join(devices)}; "
                    f"training {model} on digits for {epochs} epochs on each")
                results = fan_out("train", "all", kwargs={"model": model, "epochs": epochs},
                                  app=fleet.app()).get(timeout=600)
        except DeviceFleetError as exc:
            _fail(exc)
    _print_results(results, as_json)
    say(f"demo done in {time.perf_counter() - started:.1f} s")
    raise SystemExit(0 if all(e["status"] == "ok" for e in results.values()) else 1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--quick", is_flag=True, help="Smoke mode (CI): few runs, small batches, short jobs.")
@click.option("--cpu-workers", type=click.IntRange(1, 256), default=2, show_default=True, help="CPU devices of the bench fleet.")
def bench(as_json: bool, quick: bool, cpu_workers: int) -> None:
    """Measure a throwaway fleet against what users would do instead; print a table."""
    from .bench import report
    from .bench.run import run_bench

    say = err_console.print if as_json else console.print
    say("benchmarking an embedded fleet" + (" (quick)" if quick else "") + "...")
    try:
        figures = run_bench(_settings(), quick=quick, cpu_workers=cpu_workers)
    except DeviceFleetError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(figures, indent=2, default=str))
    else:
        console.print(report.table(figures))
        say(f"bench done in {figures['elapsed_s']:.0f} s")


# -- output ------------------------------------------------------------------------------------


def _live(url: str) -> dict[str, dict[str, Any]]:
    from . import registry

    client = registry.connect(url)
    try:
        return registry.live_workers(client)
    except Exception as exc:  # redis-py's errors, said plainly
        from .errors import FleetError

        raise FleetError(f"cannot read the fleet registry at {redact_url(url)}: {exc}") from exc
    finally:
        client.close()


def _print_status(live: dict[str, dict[str, Any]]) -> None:
    table = Table(title=f"{len(live)} live device(s)")
    for column in ("device", "worker", "pid", "state", "jobs", "CUDA_VISIBLE_DEVICES", "sees", "cores"):
        table.add_column(column)
    now = time.time()
    for device, rec in live.items():
        busy = rec.get("busy")
        state = f"busy: {busy['job']} {now - busy['since']:.0f}s" if busy else ("idle" if rec.get("ready") else "starting")
        table.add_row(
            device, str(rec.get("worker")), str(rec.get("pid")), state, str(rec.get("jobs_done", 0)),
            str(rec.get("cuda_visible_devices")),
            f"{rec.get('device_name')}" + (" (CUDA)" if rec.get("cuda_available") else ""),
            ",".join(str(c) for c in rec.get("cores", [])),
        )
    console.print(table)


_SUMMARY_KEYS = ("accuracy", "loss", "samples_per_s", "data_wait_fraction", "checkpoint")


def _print_results(results: dict[str, dict[str, Any]], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    table = Table(title="fan-out result")
    for column in ("device", "status", "worker", "seconds", "sees", "output / error"):
        table.add_column(column, overflow="fold")
    for device, entry in results.items():
        if entry["status"] == "ok":
            output = entry.get("output") or {}
            shown = {k: output[k] for k in _SUMMARY_KEYS if k in output} or {
                k: v for k, v in list(output.items())[:4] if not isinstance(v, (dict, list))
            }
            detail = ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
            status_text = "[green]ok[/]"
        else:
            detail = f"{entry['error']['type']}: {entry['error']['message']}"
            status_text = "[red]error[/]"
        vis = entry.get("visibility") or {}
        table.add_row(
            device, status_text, str(entry.get("worker")), _fmt(entry.get("duration_s")),
            f"CUDA_VISIBLE_DEVICES={vis.get('cuda_visible_devices')}, {vis.get('device_name')}", detail,
        )
    console.print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except DeviceFleetError as exc:
        _fail(exc)


if __name__ == "__main__":
    main()
