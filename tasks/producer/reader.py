"""Reading jobs' stored states and progress reports: one implementation for every handle.

A job's state is Celery's meta under its result key (``status``, ``result``...); its latest
progress report is under :func:`tasks.core.keys.progress` (kept after the job ends). A
:class:`StateReader` reads both with one ``MGET`` each, blocking (redis-py) or awaited
(``redis.asyncio``), and keeps the metas of finished jobs, which never change, so a poll reads
only the jobs still running. Fan-outs, sweeps and studies read through it
(:mod:`tasks.producer.handle`, :mod:`tasks.producer.trials`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from celery import states

from ..core import keys
from ..core.backend import entry_of_failure
from ..core.job import PROGRESS_STATE
from .connections import Connections

logger = logging.getLogger(__name__)

#: Celery states of a job a device is running.
RUNNING_STATES = frozenset({states.STARTED, PROGRESS_STATE})

Meta = dict[str, Any]


def entry_of(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The device entry of a finished job's meta; None while it has not finished."""
    if not meta or meta.get("status") not in states.READY_STATES:
        return None
    if meta["status"] == states.SUCCESS and isinstance(meta.get("result"), dict):
        return dict(meta["result"])
    entry = entry_of_failure(meta.get("result"))
    if not entry.get("device"):
        entry["device"] = None  # cancelled before any device took it
    return entry


def state_of(meta: Mapping[str, Any] | None) -> str:
    """The Celery state a meta records (``PENDING`` where none is stored)."""
    return str(meta["status"]) if meta and "status" in meta else states.PENDING


def device_of(meta: Mapping[str, Any] | None, by_worker: Mapping[str, str] | None = None) -> str | None:
    """The device running or that ran the job whose meta is ``meta`` (``by_worker`` maps a
    worker's node name to its device, from the registry)."""
    if not meta:
        return None
    result = meta.get("result")
    if isinstance(result, dict) and isinstance(result.get("device"), str) and result["device"]:
        return str(result["device"])
    worker = meta.get("worker") or (result.get("hostname") if isinstance(result, dict) else None)
    if isinstance(worker, str):
        return (by_worker or {}).get(worker, worker.split("@", 1)[0])
    return None


def _report(value: Any) -> dict[str, Any] | None:
    try:
        report = json.loads(value) if value else None
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


class StateReader:
    """Stored metas and progress reports of jobs, by task id (see the module's docstring)."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections
        self.backend = connections.app.backend
        #: Final metas (SUCCESS, FAILURE, REVOKED) by task id: read once, kept.
        self._final: dict[str, Meta] = {}
        #: The latest meta of each job that has one but has not finished (STARTED, PROGRESS).
        self._running: dict[str, Meta] = {}

    def note(self, task_id: str, meta: Meta | None) -> Meta | None:
        """Keep ``meta`` as ``task_id``'s latest (a final one is kept for good); returns the
        meta that now stands for it."""
        if task_id in self._final:
            return self._final[task_id]
        if meta is not None and meta.get("status") in states.READY_STATES:
            self._final[task_id] = meta
            self._running.pop(task_id, None)
        elif meta is not None:
            self._running[task_id] = meta
        else:
            self._running.pop(task_id, None)
        return meta

    def known(self, task_id: str) -> Meta | None:
        """The latest meta read or heard for ``task_id``, without a read."""
        return self._final.get(task_id) or self._running.get(task_id)

    def is_final(self, task_id: str) -> bool:
        return task_id in self._final

    def metas(self, task_ids: list[str]) -> dict[str, Meta | None]:
        """``{task id: stored meta or None}``: one ``MGET`` for those not final yet."""
        todo = [tid for tid in task_ids if tid not in self._final]
        if todo:
            for tid, meta in zip(todo, self.backend.metas(todo), strict=True):
                self.note(tid, meta)
        return {tid: self.known(tid) for tid in task_ids}

    async def ametas(self, task_ids: list[str]) -> dict[str, Meta | None]:
        """:meth:`metas`, awaited on the running loop's ``redis.asyncio`` client."""
        todo = [tid for tid in task_ids if tid not in self._final]
        if todo:
            raw = await self.connections.aio().mget([self.backend.get_key_for_task(tid) for tid in todo])
            for tid, value in zip(todo, raw, strict=True):
                try:
                    meta = self.backend.decode(value) if value is not None else None
                except Exception:  # noqa: BLE001  (a malformed value reads as not there)
                    meta = None
                self.note(tid, meta if isinstance(meta, dict) else None)
        return {tid: self.known(tid) for tid in task_ids}

    def reports(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """``{task id: latest progress report}`` of the jobs that reported (one ``MGET``)."""
        raw = self.connections.redis.mget([keys.progress(tid) for tid in task_ids]) if task_ids else []
        return {tid: r for tid, value in zip(task_ids, raw, strict=True) if (r := _report(value)) is not None}

    async def areports(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """:meth:`reports`, awaited."""
        raw = await self.connections.aio().mget([keys.progress(tid) for tid in task_ids]) if task_ids else []
        return {tid: r for tid, value in zip(task_ids, raw, strict=True) if (r := _report(value)) is not None}
