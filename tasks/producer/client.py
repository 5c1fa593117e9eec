"""The producer's client: sends fan-outs, sweeps and studies, and owns the Redis connections their
handles read and await through.

::

    import tasks

    async with tasks.FleetClient() as fleet:           # closes its connections at the end
        handle = fleet.fan_out("train", "all", kwargs={"epochs": 3})
        async for report in handle.watch():            # each state and progress report
            print(report.key, report.state, report.progress)
        results = await handle                         # {device: entry}

    with tasks.FleetClient(app) as fleet:              # the blocking API, the same handles
        entries = fleet.sweep("train", tasks.grid({"lr": [0.1, 0.01]})).get()

    async with tasks.FleetClient() as fleet:           # a running Optuna study is a handle too
        study = await fleet.start_study("train", {"lr": {"low": 1e-3, "high": 0.3}}, 20, "accuracy")

Sending is blocking (a Celery publish and a registry read: a few Redis round trips, on the
caller's thread); waiting, watching and the ``a``-prefixed reads are awaited
(:class:`~tasks.producer.handle.JobHandle`). ``tasks.fan_out`` and ``tasks.sweep`` without a
client use the app's default connections.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core.records import WorkerRecord
from .connections import Connections
from .fanout import ALL, FanOut, JobLike, fan_out, live_devices
from .sweep import Sweep, sweep

if TYPE_CHECKING:
    from .optimize import StudyHandle

logger = logging.getLogger(__name__)


class FleetClient(Connections):
    """A client of one fleet (``app``, default ``tasks.app``): :meth:`fan_out`, :meth:`sweep`,
    :meth:`start_study` and :meth:`live_devices` as the module functions, through this client's connections,
    closed with it (``close()``, ``with``, ``async with``)."""

    def fan_out(self, jobs: JobLike | Mapping[str, JobLike], devices: str | Sequence[str] = ALL,
                **options: Any) -> FanOut:
        """:func:`tasks.fan_out` through this client (the same arguments, less ``app``)."""
        return fan_out(jobs, devices, app=self.app, client=self, **options)

    def sweep(self, job: JobLike, trials: Sequence[Mapping[str, Any]], devices: str | Sequence[str] = ALL,
              **options: Any) -> Sweep:
        """:func:`tasks.sweep` through this client (the same arguments, less ``app``)."""
        return sweep(job, trials, devices, app=self.app, client=self, **options)

    def start_study(self, job: JobLike, space: Mapping[str, Any], n_trials: int, objective: str,
                    **options: Any) -> StudyHandle:
        """:func:`tasks.start_study` through this client: a running Optuna study's handle
        (``await`` it for the :class:`optuna.Study`; needs the ``sweep`` extra)."""
        from .optimize import start_study

        return start_study(job, space, n_trials, objective, app=self.app, client=self, **options)

    def live_devices(self) -> dict[str, WorkerRecord]:
        """``{device: registry record}`` of the fleet's live workers."""
        return live_devices(client=self)

    def __enter__(self) -> FleetClient:
        return self

    async def __aenter__(self) -> FleetClient:
        return self
