"""The dispatch baseline: a plain Celery + Redis setup, as users write it by hand.

It runs in the same ``devicefleet bench`` run as the fleet's figures, on the same Redis (another
database), with the Celery settings the fleet gives Celery where the comparison is about
mechanism: JSON only, late acks, one prefetched message, results in Redis with extended results
and STARTED states, worker task events on, two workers of one thread each, each pinned to the
cores of the fleet device it stands for and logging at the fleet workers' level. None of
devicefleet's own work is on its task path (no registry, leases, metrics or progress): the
difference is what the fleet's guarantees cost.

Its workers run ``celery -A tasks.bench.plain worker``; the URL comes from ``PLAIN_URL_ENV``,
the cores from ``PLAIN_CORES_ENV``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery, chord, signals

from ..core.devices import format_core_list, parse_core_list
from ..core.shadow import python_child
from ..ops.proc import stop_process

logger = logging.getLogger(__name__)

PLAIN_URL_ENV = "DEVICEFLEET_BENCH_PLAIN_URL"
PLAIN_CORES_ENV = "DEVICEFLEET_BENCH_PLAIN_CORES"
#: The Redis database the baseline uses, apart from the fleet's.
PLAIN_DB = 15


def make_app(url: str) -> Celery:
    """A plain Celery app on ``url``; producers send to its tasks by name."""
    plain = Celery("plain", broker=url, backend=url, set_as_current=False)
    plain.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json",
        result_accept_content=["json"], task_acks_late=True, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        # As the fleet configures Celery (tasks.core.app.celery_config): task events for
        # Flower, extended results, STARTED states; no task-sent events.
        worker_send_task_events=True, task_send_sent_event=False, result_extended=True,
        task_track_started=True,
    )
    return plain


#: The app the baseline's workers load (``celery -A tasks.bench.plain``), with its two tasks.
app = make_app(os.environ.get(PLAIN_URL_ENV, "redis://127.0.0.1:6379/15"))


@signals.celeryd_init.connect
def _pin_to_cores(**_: Any) -> None:
    """Pin the worker to its device's cores, as the fleet's workers pin themselves: the first
    thing the worker does, so the threads it starts later inherit the mask."""
    cores = os.environ.get(PLAIN_CORES_ENV)
    if cores:
        os.sched_setaffinity(0, parse_core_list(cores))


@app.task(name="plain.noop")
def noop() -> None:
    return None


@app.task(name="plain.collect")
def collect(results: list[Any]) -> list[Any]:
    return results


def plain_url(fleet_url: str) -> str:
    """The fleet's Redis URL with the baseline's database."""
    parts = urlsplit(fleet_url)
    return urlunsplit(parts._replace(path=f"/{PLAIN_DB}"))


@contextmanager
def plain_workers(url: str, cores: list[list[int] | None], log_dir: Path,
                  loglevel: str = "INFO") -> Iterator[tuple[Celery, list[str]]]:
    """One plain Celery worker per entry of ``cores`` (pinned to those cores; ``None``: not
    pinned), one queue each, logging at ``loglevel``; yields a producer app and the queues."""
    queues = [f"plain{i}" for i in range(len(cores))]
    procs = []
    for queue, mask in zip(queues, cores, strict=True):
        env = {**os.environ, PLAIN_URL_ENV: url}
        if mask:
            env[PLAIN_CORES_ENV] = format_core_list(mask)
        # `celery -A tasks.bench.plain worker`, never a tasks.py in the working directory.
        argv, env = python_child("tasks.ops.celery_main", "-A", "tasks.bench.plain", "worker", "-Q", queue,
                                 "-n", f"{queue}@%h", "--pool", "threads", "--concurrency", "1",
                                 "--loglevel", loglevel, env=env)
        with open(log_dir / f"{queue}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    producer = make_app(url)
    try:
        for queue in queues:  # ready when each answers a job
            producer.signature("plain.noop", queue=queue).apply_async().get(timeout=120)
        yield producer, queues
    finally:
        for proc in procs:
            stop_process(proc, timeout=30)
        producer.close()


def chord_round_trips(producer: Celery, queues: list[str], runs: int, warmup: int = 5) -> list[float]:
    """Seconds per two-job chord (a noop per queue, then collect), as users write a fan-out."""
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        header = [producer.signature("plain.noop", queue=q) for q in queues]
        chord(header)(producer.signature("plain.collect", queue=queues[0])).get(timeout=60)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def throughput(producer: Celery, queues: list[str], jobs: int) -> float:
    """No-op jobs per second from one producer over the baseline's workers."""
    sigs = [producer.signature("plain.noop", queue=q) for q in queues]
    t0 = time.perf_counter()
    results = [sigs[i % len(sigs)].apply_async() for i in range(jobs)]
    for res in results:
        res.get(timeout=120)
    return jobs / (time.perf_counter() - t0)
