"""The dispatch baseline: a plain Celery + Redis setup, as users write it by hand.

It runs in the same ``devicefleet bench`` run as the fleet's figures, on the same Redis (another
database), with the settings a careful user picks: JSON only, late acks, one prefetched message,
results in Redis, two workers of one thread each. None of devicefleet's own work is on its task
path (no registry, leases, metrics, events or progress): it shows what the fleet's guarantees cost.

Its workers run ``celery -A tasks.bench.plain worker``; the URL comes from ``PLAIN_URL_ENV``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery, chord

from ..ops.proc import stop_process

logger = logging.getLogger(__name__)

PLAIN_URL_ENV = "DEVICEFLEET_BENCH_PLAIN_URL"
#: The Redis database the baseline uses, apart from the fleet's.
PLAIN_DB = 15


def make_app(url: str) -> Celery:
    """A plain Celery app on ``url``; producers send to its tasks by name."""
    plain = Celery("plain", broker=url, backend=url, set_as_current=False)
    plain.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json",
        result_accept_content=["json"], task_acks_late=True, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
    )
    return plain


#: The app the baseline's workers load (``celery -A tasks.bench.plain``), with its two tasks.
app = make_app(os.environ.get(PLAIN_URL_ENV, "redis://127.0.0.1:6379/15"))


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
def plain_workers(url: str, count: int, log_dir: Path) -> Iterator[tuple[Celery, list[str]]]:
    """``count`` plain Celery workers, one queue each; yields a producer app and the queues."""
    env = {**os.environ, PLAIN_URL_ENV: url}
    queues = [f"plain{i}" for i in range(count)]
    procs = []
    for queue in queues:
        with open(log_dir / f"{queue}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tasks.bench.plain", "worker", "-Q", queue,
                 "-n", f"{queue}@%h", "--pool", "threads", "--concurrency", "1", "--loglevel", "WARNING"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))
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
