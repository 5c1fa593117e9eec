"""Scale (issue 63): what one Redis carries, by devices and by users.

- ``idle_users``: a two-device no-op fan-out (:func:`tasks.bench.dispatch.fanout_round_trips`)
  with one known user, then again once ``idle_users`` more users have each sent one job (none
  waiting now); beside each, one worker's ``BRPOP`` arguments (``CLIENT LIST``'s ``argv-mem``)
  and Redis' time per ``BRPOP`` (``INFO commandstats``).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import redis
from celery import Celery

from ..core.defaults import FAIRSHARE_REFRESH_S
from ..core.queues import device_queue
from ..core.queue_lists import QueueLists
from ..core.registry import connect
from ..producer.fanout import JobSpec, prioritized
from .dispatch import fanout_round_trips

logger = logging.getLogger(__name__)

#: How long every idle worker takes to read the users again: its poll's timeout (kombu's
#: ``brpop_timeout``, 1 s) and the refresh period, with a margin.
SETTLE_S = 1.0 + FAIRSHARE_REFRESH_S + 1.0


def brpop_figures(client: redis.Redis, devices: list[str]) -> dict[str, float]:
    """Redis' time per ``BRPOP`` since the last ``CONFIG RESETSTAT`` (µs) and the largest
    ``argv-mem`` of a client blocked in one now (bytes): a worker's poll's arguments."""
    stats = client.info("commandstats").get("cmdstat_brpop", {})
    polls = [c for c in client.client_list() if c.get("cmd") == "brpop"]
    return {"brpop_us": float(stats.get("usec_per_call", 0.0)), "brpop_calls": float(stats.get("calls", 0)),
            "brpop_argv_bytes": float(max((int(c.get("argv-mem", 0)) for c in polls), default=0))}


def fanouts(app: Celery, devices: list[str], client: redis.Redis, runs: int) -> dict[str, float]:
    """The median two-device no-op fan-out (ms) and the poll figures over those fan-outs."""
    fanout_round_trips(app, devices, 0, warmup=3)
    client.config_resetstat()
    times = fanout_round_trips(app, devices, runs, warmup=0)
    return {"fanout_ms_p50": 1000 * statistics.median(times), **brpop_figures(client, devices)}


def send_once(app: Celery, devices: list[str], client: redis.Redis, users: list[str]) -> None:
    """Each of ``users`` sends one no-op job to the devices in turn, through the fleet's publish,
    expired as it is sent (a worker takes it and drops it: a job process per user would take a
    process start each); returns once every device's queue is empty."""
    noop = JobSpec.of("noop")
    for i, user in enumerate(users):
        prioritized(noop, user=user).signature(app, device_queue(devices[i % len(devices)])).apply_async(expires=1e-3)
    deadline = time.monotonic() + 120
    while any(QueueLists.read(client, device_queue(d)).count(client) for d in devices):
        if time.monotonic() > deadline:
            raise RuntimeError("the users' jobs still wait after 120 s")
        time.sleep(0.2)


def idle_users(app: Celery, devices: list[str], client: redis.Redis, count: int, runs: int) -> dict[str, Any]:
    """The fan-out and a worker's poll with one known user, then with ``count`` more who sent a
    job each, none waiting."""
    one = fanouts(app, devices, client, runs)
    send_once(app, devices, client, [f"idle{i}" for i in range(count)])
    time.sleep(SETTLE_S)
    many = fanouts(app, devices, client, runs)
    return {"users": count, "one_user": one, "many_users": many,
            "fanout_vs_one_user": many["fanout_ms_p50"] / one["fanout_ms_p50"],
            "argv_vs_one_user": many["brpop_argv_bytes"] / max(1.0, one["brpop_argv_bytes"]),
            "brpop_us_vs_one_user": many["brpop_us"] / max(1e-9, one["brpop_us"])}


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any]:
    """The scale figures (see the module's docstring)."""
    client = connect(str(app.conf.broker_url))
    out: dict[str, Any] = {}
    idle = idle_users(app, devices, client, 20 if quick else 300, 20 if quick else 60)
    out.update(idle_fanout_vs_one_user=idle["fanout_vs_one_user"], idle_argv_vs_one_user=idle["argv_vs_one_user"],
               idle_users=idle)
    logger.info("scale: %s", out)
    return out
