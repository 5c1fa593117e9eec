"""Device groups on the bench fleet: a group's start latency against a single job's, and its wait
behind single jobs (figures of the ``groups`` section, beside the Hogwild ones of :mod:`.groups`).

On the bench fleet's first two CPU devices (one host):

- ``start_s_single``, ``start_s_group``: from the send to the job's start (its entry's
  ``started_at``: for a group, once every device holds it), devices idle, median of the rounds;
  ``start_vs_single`` their ratio (the issue's aim: at most 1.2);
- ``wait_s``, ``wait_beyond_longest_s``: a ``busy_s`` single job runs on each device (the group
  is sent once both have started) and more arrive back to back on both; a group sent among them
  starts ``wait_s`` after it was sent, and this long after the longest job that ran when it was
  sent ended (the issue's aim: at most a second). Its producer reserves the devices other than
  its leader as it sends it, so none of them starts a job sent after it.
"""

from __future__ import annotations

import logging
import statistics
import time
from datetime import datetime
from typing import Any

from celery import Celery

from ..producer.fanout import fan_out
from ..producer.reader import RUNNING_STATES

logger = logging.getLogger(__name__)

#: Seconds each single job of the wait round keeps its device busy (``probe``'s sleep).
BUSY_S = 2.0
QUICK_BUSY_S = 0.5
#: Single jobs sent to each device after the group, back to back.
FOLLOWERS = 3


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _start_latency(app: Celery, devices: list[str], group: int | None) -> float:
    sent = time.time()
    results = fan_out("probe", devices, group=group, app=app).get(timeout=120)
    (entry,) = results.values()
    if entry["status"] != "ok":
        raise RuntimeError(f"bench groups: {entry['error']}")
    return _ts(entry["started_at"]) - sent


def measure(app: Celery, cpus: list[str], *, quick: bool = False) -> dict[str, Any] | None:
    """The figures of the module's docstring; None with fewer than two CPU devices."""
    if len(cpus) < 2:
        return None
    pair = cpus[:2]
    rounds = 1 if quick else 5
    _start_latency(app, pair, 2)  # warm: the first group's process pinning, the registry reads
    single = statistics.median(_start_latency(app, pair[:1], None) for _ in range(rounds))
    group = statistics.median(_start_latency(app, pair, 2) for _ in range(rounds))
    busy_s = QUICK_BUSY_S if quick else BUSY_S
    busy = {"busy_s": busy_s, "mode": "sleep"}
    running = [fan_out("probe", [device], kwargs=busy, app=app) for device in pair]
    deadline = time.monotonic() + 120
    while not all(set(handle.states().values()) <= RUNNING_STATES for handle in running):
        if time.monotonic() > deadline:
            raise RuntimeError("bench groups: the busy jobs did not start within 120 s")
        time.sleep(0.01)
    sent = time.time()
    grouped = fan_out("probe", pair, group=2, app=app)
    followers = [fan_out("probe", [device], kwargs=busy, app=app) for _ in range(FOLLOWERS) for device in pair]
    ends = [_ts(entry["finished_at"]) for handle in running for entry in handle.get(timeout=120).values()]
    (entry,) = grouped.get(timeout=120).values()
    for handle in followers:
        handle.get(timeout=120)
    wait = _ts(entry["started_at"]) - max(ends)
    logger.info("groups: start %.3f s against %.3f s single; waited %.3f s past the longest job", group, single, wait)
    return {"rounds": rounds, "start_s_single": single, "start_s_group": group,
            "start_vs_single": group / single if single > 0 else float("inf"),
            "busy_s": busy_s, "wait_s": _ts(entry["started_at"]) - sent, "wait_beyond_longest_s": wait}
