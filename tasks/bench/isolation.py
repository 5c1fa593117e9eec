"""Job isolation: how fast a device recovers from a job that crashes its process or hangs.

Each job runs in a supervised job process, with a warm spare beside it. Measured on one device
of the bench fleet, with the misbehaving jobs of :mod:`.misbehave` (allowlisted there only):

- ``crash_to_entry_s``: a ``segfault`` job records ``time.time()`` and kills its own process with
  SIGSEGV; from then until the producer has its ``JobCrashed`` entry (``handle.get()`` returns);
- ``next_job_after_crash_s``: from the same crash until the next job, queued behind the crashing
  one on the same device (which waits :data:`CRASH_DELAY_S` before it crashes, so the next job
  is queued by then), starts (the ``stamp`` job records its start);
- ``cancel_to_free_s``: a ``hang`` job sleeps and never calls ``ctx.progress()``; from
  ``handle.cancel()`` until the next job, queued behind it, starts. The fleet's
  ``cancel_grace_s`` (:data:`CANCEL_GRACE_S` in the bench's worker configs, reported as
  ``cancel_grace_s``) is part of it: the job cannot stop by itself, so its process is ended;
- ``respawn_s``: from the crash until the device has a warm spare again (its registry record
  lists two live job processes), which it waits for before each round;
- ``next_job_same_user_s``: from the send of a ``stamp`` job until it starts, right after a job
  of the same user on the device: it runs in that user's warm process (a job process runs one
  user's jobs: :mod:`tasks.worker.owners`);
- ``next_job_other_user_s``: the same for a job of a user new to the device, right after: it
  runs in the warm spare, never in the process the last user's job ran in (the user has sent a
  job to another device first, :data:`USER_SETTLE_S` before, where the fleet has one).

Each figure is the median over the rounds, with every round's own beside it (``*_rounds``).
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from celery import Celery

from ..core.records import Entry, EntryStatus
from ..ops.proc import wait_until
from ..producer.fanout import FanOut, fan_out, live_devices
from ..worker.supervisor import SPARE_PROCESSES

logger = logging.getLogger(__name__)

#: The module of the misbehaving jobs, allowlisted in the bench fleet only.
JOB_MODULE = "tasks.bench.misbehave"
#: The bench fleet's ``cancel_grace_s``: short, so ``cancel_to_free_s`` is about the mechanism
#: (stop request, process group ended, entry, next job) rather than the default 5 s wait.
CANCEL_GRACE_S = 1.0
#: Seconds any one step may take before the bench gives up (a fresh job process imports torch).
STEP_TIMEOUT_S = 120.0
POLL_S = 0.02
#: How long the ``segfault`` job waits before it crashes, so that the next job is queued behind
#: it by then: ``next_job_after_crash_s`` is the device's recovery, not the producer's send.
CRASH_DELAY_S = 0.2
#: How long a user new to the fleet takes to be served by a worker idle in its blocking read
#: (fair share's lists are read again once that read times out: kombu's ``brpop_timeout``, 1 s),
#: waited after the user's first job elsewhere, so ``next_job_other_user_s`` is the device's
#: process choice, not fair share's discovery of a user.
USER_SETTLE_S = 2.0


def write_worker_configs(source: Path, dest: Path, cancel_grace_s: float = CANCEL_GRACE_S) -> Path:
    """Copy every ``*.toml`` of ``source`` into ``dest`` with ``cancel_grace_s`` set; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.toml")):
        text = re.sub(r"(?m)^[ \t]*cancel_grace_s[ \t]*=.*\n?", "", path.read_text())
        # A top-level key before the file's own content is valid TOML whatever tables follow.
        (dest / path.name).write_text(
            f"# devicefleet bench: a short grace, so isolation.cancel_to_free_s is about the mechanism\n"
            f"cancel_grace_s = {cancel_grace_s!r}\n\n{text}")
    return dest


def _wait(check: Callable[[], Any], what: str) -> Any:
    """Poll ``check`` until it returns something truthy (:func:`tasks.ops.proc.wait_until`)."""
    return wait_until(check, STEP_TIMEOUT_S, f"isolation bench: {what}", poll=POLL_S)


def wait_warm(app: Celery, device: str, gone: Collection[int] = ()) -> float:
    """Wait until ``device`` lists a job process per slot and its spares (processes that ran no
    job yet), none of them in ``gone`` (processes that were ended); returns ``time.time()`` then."""
    def warm() -> float | None:
        record = live_devices(app).get(device)
        if record is None or set(record.job_pids) & set(gone):
            return None
        if len(record.job_pids) < record.slot_count + SPARE_PROCESSES or len(record.spare_pids) < SPARE_PROCESSES:
            return None
        return time.time()

    return float(_wait(warm, f"{device} getting a warm spare job process again"))


def _marker(directory: Path, handle: FanOut, device: str) -> dict[str, Any] | None:
    """What the job of ``handle`` on ``device`` wrote before it misbehaved, or None yet."""
    try:
        return dict(json.loads((directory / f"{handle.task_ids[device]}.json").read_text()))
    except FileNotFoundError:
        return None


def _entry(handle: FanOut, device: str) -> dict[str, Any]:
    return handle.get(timeout=STEP_TIMEOUT_S)[device]


def _started(handle: FanOut, device: str) -> float:
    entry = _entry(handle, device)
    if not Entry.parse(entry).ok:
        raise RuntimeError(f"isolation bench: the stamp job after a misbehaving one failed: {entry['error']}")
    return float(entry["output"]["started"])


def crash_round(app: Celery, device: str, markers: Path) -> dict[str, float]:
    """One ``segfault`` job and a ``stamp`` queued behind it: the crash's figures."""
    crash = fan_out(("segfault", {"marker_dir": str(markers), "delay_s": CRASH_DELAY_S}), [device], app=app)
    following = fan_out("stamp", [device], app=app)
    queued_at = time.time()
    entry = _entry(crash, device)
    entry_at = time.time()
    if Entry.parse(entry).status is not EntryStatus.ERROR or (entry["error"] or {}).get("type") != "JobCrashed":
        raise RuntimeError(f"isolation bench: the segfault job did not end as JobCrashed: {entry}")
    mark = _marker(markers, crash, device)
    if mark is None:
        raise RuntimeError(f"isolation bench: the segfault job crashed before writing its time: {entry['error']}")
    if queued_at > mark["t"]:
        logger.warning("isolation: the next job was queued %.3f s after the crash (a slow host): "
                       "next_job_after_crash_s includes its send", queued_at - mark["t"])
    started = _started(following, device)
    warm_at = wait_warm(app, device, gone=[int(mark["pid"])])
    return {"crash_to_entry_s": entry_at - mark["t"], "next_job_after_crash_s": started - mark["t"],
            "respawn_s": warm_at - mark["t"]}


def _stamp(app: Celery, device: str, user: str | None) -> tuple[float, int]:
    """A ``stamp`` job of ``user``: seconds from its send until it started, and its pid."""
    sent = time.time()
    handle = fan_out("stamp", [device], user=user, app=app)
    started = _started(handle, device)
    return started - sent, int(_entry(handle, device)["output"]["pid"])


def users_round(app: Celery, device: str, tag: str) -> dict[str, float]:
    """The bench's user's job right after one of theirs, then a job of a user new to the device
    (``bench-<tag>``, known to the fleet); each from the steady state, and back to it."""
    other_user = f"bench-{tag}"
    elsewhere = sorted(d for d in live_devices(app) if d != device)
    if elsewhere:
        _stamp(app, elsewhere[0], other_user)
        time.sleep(USER_SETTLE_S)
    else:
        logger.warning("isolation: one device only: next_job_other_user_s includes fair share's discovery of a user")
    _, first = _stamp(app, device, None)
    same_s, again = _stamp(app, device, None)
    if again != first:
        raise RuntimeError(f"isolation bench: the next job of the same user ran in process {again}, "
                           f"not in its warm {first}")
    wait_warm(app, device)
    other_s, other = _stamp(app, device, other_user)
    if other == first:
        raise RuntimeError(f"isolation bench: another user's job ran in process {first}, which ran the bench user's")
    wait_warm(app, device)
    return {"next_job_same_user_s": same_s, "next_job_other_user_s": other_s}


def cancel_round(app: Celery, device: str, markers: Path) -> dict[str, float]:
    """One ``hang`` job, cancelled once it runs, and a ``stamp`` queued behind it."""
    hung = fan_out(("hang", {"marker_dir": str(markers)}), [device], app=app)
    following = fan_out("stamp", [device], app=app)
    mark = _wait(lambda: _marker(markers, hung, device), f"the hang job starting on {device}")
    cancelled_at = time.time()
    hung.cancel()
    entry = _entry(hung, device)
    entry_at = time.time()
    if Entry.parse(entry).status is not EntryStatus.CANCELLED:
        raise RuntimeError(f"isolation bench: the cancelled hang job's entry is not 'cancelled': {entry}")
    started = _started(following, device)
    wait_warm(app, device, gone=[int(mark["pid"])])
    return {"cancel_to_entry_s": entry_at - cancelled_at, "cancel_to_free_s": started - cancelled_at}


def measure(app: Celery, device: str, *, quick: bool, cancel_grace_s: float) -> dict[str, Any]:
    """``{"crash_to_entry_s", "next_job_after_crash_s", "cancel_to_free_s", "cancel_grace_s", ...}``
    on ``device``, whose workers run with ``cancel_grace_s`` (the figure reports it)."""
    rounds = 1 if quick else 5
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-isolation-") as tmp:
        markers = Path(tmp)
        wait_warm(app, device)
        _started(fan_out("stamp", [device], app=app), device)  # warm: the first job's costs
        for index in range(rounds):
            # Each step starts from the steady state (a warm spare) that the last one waited for.
            for figures in (crash_round(app, device, markers), cancel_round(app, device, markers),
                            users_round(app, device, f"{index}-{uuid.uuid4().hex[:8]}")):
                for key, value in figures.items():
                    samples.setdefault(key, []).append(value)
    out: dict[str, Any] = {key: statistics.median(values) for key, values in samples.items()}
    out.update({f"{key}_rounds": values for key, values in samples.items()})
    out.update(rounds=rounds, device=device, cancel_grace_s=cancel_grace_s)
    logger.info("isolation: %s", out)
    return out
