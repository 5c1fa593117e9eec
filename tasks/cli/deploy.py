"""``devicefleet deploy``: systemd units and configs for this host's devices."""

from __future__ import annotations

from pathlib import Path

import click

from ..core.defaults import STOP_MARGIN_S
from ..core.devices import DeviceNames
from ..core.errors import EXIT_CONFIG, DeviceFleetError
from ..ops.deploy import join_commands, plan_host, render
from .helpers import console, fail


@click.command()
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
    try:
        plan = plan_host(
            gpus=gpus, cpu_workers=cpu_workers, join_url=join_url, serve_address=serve_address,
            sentinel_hosts=sentinel_hosts.split(",") if sentinel_hosts is not None else None, this_host=this_host,
            device_names=DeviceNames(device_names) if device_names else None, root=root,
            devicefleet_bin=devicefleet_bin, state_dir=state_dir, stop_margin_s=stop_margin, job_users=job_users,
        )
        done = render(plan, root)
    except DeviceFleetError as exc:  # the options, checked before anything is written
        fail(exc, EXIT_CONFIG)
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
