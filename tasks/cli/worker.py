"""``devicefleet worker NAME``: the worker that owns a device, the command its systemd unit runs."""

from __future__ import annotations

import click

from ..core.app import create_app
from ..core.devices import host_name
from ..core.errors import EXIT_CONFIG, DeviceFleetError
from ..core.worker_config import load_worker_config
from ..ops import celery_main
from .helpers import fail, load_settings


@click.command()
@click.argument("name")
@click.option("--cores", help="CPU list this worker owns, e.g. 0-3 (default: the config's, else a share).")
@click.option("--redis-url", help="Broker and backend (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
@click.option("--loglevel", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="Override the config's log level.")
def worker(name: str, cores: str | None, redis_url: str | None, loglevel: str | None) -> None:
    """Run the worker that owns device NAME (cpu0, gpu1...) in the foreground."""
    # Validated here, at the edge, and handed to the worker's app: the worker's steps read
    # these settings, never the environment again.
    settings = load_settings(cores=cores, redis_url=redis_url)
    try:
        device = settings.device(name)
        config = load_worker_config(settings.worker_configs_path, device)
        settings = settings.model_copy(update={"redis_url": settings.resolve_redis_url()})
    except DeviceFleetError as exc:  # all of it the worker's settings: restarting cannot help
        fail(exc, EXIT_CONFIG)
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
