"""A finished job's count for the fleet's metrics: the one record its writer, the store script
and the exporter share.

A device worker counts each job it ends (:func:`tasks.worker.accounting.job_end` builds its
:class:`JobCount`); the script that stores the job's result adds it to the device's stats hash
``keys.stats(device)`` in the same call (:data:`tasks.core.jobscripts.STORE`, which reads the
fields of :meth:`JobCount.script_arg`, :data:`SCRIPT_FIELDS`); :mod:`tasks.ops.exporter` reads
the hash back as :class:`DeviceStats`. The hash's fields are the record's field names: each
field of :class:`JobCount` says how it is tallied (:class:`Tally`), and :class:`DeviceStats`
reads a field of the same name. A job's declared metrics (``@job(..., metrics=...)``) go in
under their own names (counters) or as ``last_<name>`` (gauges): never a name this module
knows.

Adding a figure to a job's end: a field on :class:`JobCount` (with its tally), the same name on
:class:`DeviceStats`, the value where the worker builds the count, the reading in the exporter
(``tests/test_jobend.py`` checks the two records agree and that the script reads what the
record sends).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import redis

from . import keys
from .defaults import FINISHED_KEEP_S
from .job import JobMetric

#: The stats hash's counts of jobs by outcome (one more per job: HINCRBY).
JOBS_OK = "jobs_ok"
JOBS_ERROR = "jobs_error"

#: The fields of :meth:`JobCount.script_arg`, which the store script reads (``count.<field>``).
SCRIPT_FIELDS = ("device", "outcome", "add", "set", "finished", "keep_after", "share", "wait")


class Tally(str, Enum):
    """How a field of :class:`JobCount` reaches its device's stats hash."""

    #: Summed over the device's jobs (HINCRBYFLOAT).
    ADD = "add"
    #: The last job's value (HSET).
    LATEST = "set"


def _tally(kind: Tally) -> dict[str, Tally]:
    return {"tally": kind}


def gauge_field(metric: JobMetric) -> str:
    """The stats hash's field of a gauge metric: the last job's value."""
    return f"last_{metric.value}"


@dataclass(frozen=True)
class JobCount:
    """One finished job's figures, added to its device's stats hash by the script that stores
    its result. Fields with a :class:`Tally` are stats hash fields of the same name.

    Attributes:
        device: whose stats hash (``keys.stats(device)``) and finish times it goes to.
        ok: counted as ``jobs_ok`` if true, else ``jobs_error``.
        metrics: the job's declared metrics: counters added, gauges kept as ``last_<name>``.
    """

    device: str
    ok: bool
    #: The worker that ran it.
    worker: str = field(metadata=_tally(Tally.LATEST))
    #: Seconds the device spent on it.
    busy_seconds: float = field(metadata=_tally(Tally.ADD))
    #: When it finished (epoch seconds); also its score in ``keys.finished(device)``.
    last_finished_at: float = field(metadata=_tally(Tally.LATEST))
    #: GPU memory its job process held at the end (None: not measured).
    gpu_memory_bytes: int | None = field(default=None, metadata=_tally(Tally.LATEST))
    metrics: Mapping[JobMetric, float] = field(default_factory=dict)
    #: What the job adds to its user's usage and its level's counters
    #: (:func:`tasks.core.fairshare.share_arg`; empty: it names no user).
    share: Mapping[str, str] = field(default_factory=dict)
    #: Its wait from send to start, for its level's histogram (:func:`tasks.core.fairshare.wait_arg`).
    wait: Mapping[str, str] = field(default_factory=dict)

    def script_arg(self) -> str:
        """The count as the store script reads it: JSON of :data:`SCRIPT_FIELDS`. Numbers travel
        as ``repr`` strings, so Redis stores what Python would have written."""
        tallied: dict[Tally, dict[str, str]] = {Tally.ADD: {}, Tally.LATEST: {}}
        for f in fields(self):
            kind = f.metadata.get("tally")
            value = getattr(self, f.name)
            if kind is not None and value is not None:
                tallied[kind][f.name] = value if isinstance(value, str) else repr(value)
        for metric, value in self.metrics.items():
            if metric.is_counter:
                tallied[Tally.ADD][metric.value] = repr(float(value))
            else:
                tallied[Tally.LATEST][gauge_field(metric)] = repr(value)
        arg = {
            "device": self.device, "outcome": JOBS_OK if self.ok else JOBS_ERROR,
            Tally.ADD.value: tallied[Tally.ADD], Tally.LATEST.value: tallied[Tally.LATEST],
            "finished": repr(self.last_finished_at), "keep_after": repr(self.last_finished_at - FINISHED_KEEP_S),
            "share": dict(self.share), "wait": dict(self.wait),
        }
        return json.dumps(arg)


def _read(parse: Callable[[str], Any]) -> dict[str, Callable[[str], Any]]:
    return {"read": parse}


@dataclass(frozen=True)
class DeviceStats:
    """A device's stats hash read back: the sum of its jobs' :class:`JobCount`, by the record's
    field names (plus the outcome counts and the declared metrics)."""

    jobs_ok: int = field(default=0, metadata=_read(int))
    jobs_error: int = field(default=0, metadata=_read(int))
    worker: str | None = field(default=None, metadata=_read(str))
    busy_seconds: float = field(default=0.0, metadata=_read(float))
    last_finished_at: float | None = field(default=None, metadata=_read(float))
    gpu_memory_bytes: int | None = field(default=None, metadata=_read(int))
    #: Jobs this device's worker stopped itself, cut off from Redis (self-fencing), or because a
    #: newer attempt took their lease; counted when it reports them
    #: (:data:`tasks.core.jobscripts.FENCED`).
    jobs_fenced: int = field(default=0, metadata={"script": int})
    #: Writes of this device's attempts refused for an older fencing token than the job's (a
    #: late store of a cut-off run: :data:`tasks.core.jobscripts.STORE`).
    writes_refused: int = field(default=0, metadata={"script": int})
    #: Jobs this device's worker preempted: made way for higher-level work, sent back to their
    #: queue (:func:`count_preemption`).
    jobs_preempted: int = field(default=0, metadata={"script": int})
    #: The counter metrics, summed.
    counters: Mapping[JobMetric, float] = field(default_factory=dict)
    #: The gauge metrics, the last job's.
    gauges: Mapping[JobMetric, float] = field(default_factory=dict)

    @property
    def jobs_total(self) -> int:
        return self.jobs_ok + self.jobs_error

    @classmethod
    def parse(cls, raw: Mapping[str, str]) -> DeviceStats:
        """Read a device's stats hash (``HGETALL keys.stats(device)``, decoded)."""
        values = {f.name: f.metadata["read"](raw[f.name]) for f in fields(cls)
                  if "read" in f.metadata and f.name in raw}
        # The fencing scripts' own counters (not a job's count's).
        values.update({f.name: f.metadata["script"](raw[f.name]) for f in fields(cls)
                       if "script" in f.metadata and f.name in raw})
        counters = {m: float(raw[m.value]) for m in JobMetric if m.is_counter and m.value in raw}
        gauges = {m: float(raw[gauge_field(m)]) for m in JobMetric
                  if not m.is_counter and gauge_field(m) in raw}
        return cls(**values, counters=counters, gauges=gauges)


def count_preemption(client: redis.Redis, device: str) -> None:
    """Add one to ``device``'s preempted jobs (its stats hash's ``jobs_preempted``).

    Raises:
        redis.RedisError: Redis could not be reached.
    """
    with client.pipeline(transaction=False) as pipe:
        pipe.hincrby(keys.stats(device), "jobs_preempted", 1)
        pipe.sadd(keys.STATS_DEVICES, device)
        pipe.execute()
