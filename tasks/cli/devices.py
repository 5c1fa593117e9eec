"""The fleet's state: ``status`` (its devices, workers, queues) and ``device`` (drain, undrain,
list: a device's service state, whose logic is :mod:`tasks.ops.devices_admin`)."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import click
from rich.live import Live
from rich.markup import escape

from ..core.defaults import STATUS_WATCH_INTERVAL_S
from ..core.errors import EXIT_CONFIG, DeviceFleetError, FleetError, UnknownDevice
from ..core.registry import reading
from ..core.settings import read_fleet_file
from ..core.stopflag import StopFlag
from ..ops.devices_admin import drain, listing, undrain
from ..ops.status import render, report
from ..ops.status import table as fit_table
from .helpers import ERROR_PREFIX, console, fail, load_settings
from .results import producer_app


@click.command()
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
    settings = load_settings(redis_url=redis_url)
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
        # Ctrl-C sets an event the loop waits on, rather than raising KeyboardInterrupt wherever
        # the main thread happens to be (inside a Redis read, or inside rich's Live with its
        # refresh thread): a Ctrl-C there could leave `status --watch` running, and CI saw one
        # that did not exit.
        stop = StopFlag()
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


@click.group()
def device() -> None:
    """Take a device out of service and back (drain, undrain), or list the devices' states."""


@device.command("drain")
@click.argument("name")
@click.option("--reason", required=True, help="Why (shown by `device list` and `status`).")
@click.option("--now", is_flag=True, help="Hand its running jobs back to their queue now instead of letting them finish.")
@click.option("--redis-url", help="Fleet (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def device_drain(name: str, reason: str, now: bool, redis_url: str | None) -> None:
    """Take device NAME out of service: it takes no new job, keeps its heartbeat; fan-outs skip it."""
    settings = load_settings(redis_url=redis_url)
    url = settings.resolve_redis_url()
    with reading(url) as client:
        try:
            state = drain(client, name, reason, now=now, replication=settings.replication(url))
        except UnknownDevice as exc:
            fail(exc, EXIT_CONFIG)
    click.echo(f"{name} drained by {state.by}: {reason}" + (" (running jobs handed back)" if now else ""))


@device.command("undrain")
@click.argument("name")
@click.option("--redis-url", help="Fleet (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def device_undrain(name: str, redis_url: str | None) -> None:
    """Put device NAME back in service (after a probe job, if it was drained for a hardware error)."""
    settings = load_settings(redis_url=redis_url)
    url = settings.resolve_redis_url()
    with reading(url) as client:
        try:
            state = undrain(client, name, app=producer_app(settings), replication=settings.replication(url))
        except UnknownDevice as exc:
            fail(exc, EXIT_CONFIG)
    if not state.in_service:
        fail(FleetError(f"{name} stays {state.state}: {state.reason}"))
    click.echo(f"{name} is back in service")


@device.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the devices as JSON.")
@click.option("--redis-url", help="Fleet (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def device_list(as_json: bool, redis_url: str | None) -> None:
    """Every known device's service state: ok, drained, quarantined or suspect, why, since, by whom."""
    with reading(load_settings(redis_url=redis_url).resolve_redis_url()) as client:
        rows = listing(client)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = fit_table(f"{len(rows)} device(s)", ["device", "live", "state", "reason", "since", "by"])
    for row in rows:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["since"])) if row["since"] else ""
        table.add_row(row["device"], "yes" if row["live"] else "no", row["state"], row["reason"], since, row["by"])
    console.print(table)
