"""One handle API for what a producer starts: a fan-out, a sweep, a running study.

Each is a :class:`JobHandle` over a set of jobs, each job under a key (a fan-out's device, a
sweep's or a study's trial number) and a Celery task id. The handle answers, blocking or
awaited, from one implementation (:class:`~tasks.producer.reader.StateReader`):

=====================  ==========================  =============================================
blocking               awaited                     what
=====================  ==========================  =============================================
``states()``           ``await astates()``         each job's Celery state, ``{key: state}``
``progress()``         ``await aprogress()``       each job's latest progress report
``summary()``          ``await asummary()``        done / failed / cancelled / running / queued
``ready()``            ``await aready()``          whether every job has finished
``cancel()``           ``await acancel()``         queued jobs never start, running ones stop
``get(timeout)``       ``await wait(timeout)``     the result (``await handle`` is ``wait()``)
\\                      ``async for r in watch()``  each state and progress report as published
=====================  ==========================  =============================================

Every handle answers each of them the same way, blocking or awaited; ``states()`` is
``{key: state}``, except a sweep's, whose keys are its trial numbers ``0..n-1``: a list in trial
order (as it always was), indexed by the same keys.

Awaiting listens on Redis pub/sub (:mod:`tasks.producer.listener`): the channel Celery's backend
publishes each stored state on, progress reports included; nothing polls at a fixed interval.

**Cancelling the awaiting task** (a web client that went away, ``asyncio.wait_for``, a task
group) leaves the jobs running: they belong to the handle, which other tasks may await too, as a
``timeout`` leaves them. ``await handle.wait(cancel=True)`` cancels the jobs with the task.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from celery import Celery, states

from ..core.defaults import MAX_POLL_S, MIN_POLL_S
from ..core.errors import FanOutTimeout
from ..core.job import PROGRESS_STATE
from ..core.records import Entry, EntryStatus
from .connections import Connections
from .listener import RECHECK_S
from .reader import RUNNING_STATES, Meta, StateReader, device_of, entry_of, state_of

logger = logging.getLogger(__name__)


K = TypeVar("K")
R = TypeVar("R")


@dataclass(frozen=True)
class Report(Generic[K]):
    """One job's state or progress as it was published (what :meth:`JobHandle.watch` yields)."""

    #: The job's key: a fan-out's device, a sweep's or a study's trial number.
    key: K
    task_id: str
    #: Celery's state: ``STARTED``, ``PROGRESS``, ``SUCCESS``, ``FAILURE`` or ``REVOKED``.
    state: str
    #: The job's latest progress report (``{}`` before its first).
    progress: dict[str, Any]
    #: The job's entry once it has finished, else None.
    entry: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.state in states.READY_STATES

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Summary:
    """Counts of a handle's jobs, and per device how many it ran and runs now."""

    total: int
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    running: int = 0
    queued: int = 0
    #: ``{device: {"done": n, "running": n}}`` (done counts every finished job it ran).
    devices: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def finished(self) -> int:
        return self.done + self.failed + self.cancelled


def summarize(metas: Iterable[Meta | None], devices: Iterable[str],
              device_of_meta: Callable[[Meta | None], str | None] = device_of) -> Summary:
    """The :class:`Summary` of jobs whose stored metas are ``metas``."""
    metas = list(metas)
    out = Summary(total=len(metas), devices={d: {"done": 0, "running": 0} for d in devices})
    for meta in metas:
        entry = entry_of(meta)
        running = entry is None and meta is not None and meta.get("status") in RUNNING_STATES
        if entry is None:
            out.running += running
            out.queued += not running
        elif (status := Entry.parse(entry).status) is EntryStatus.OK:
            out.done += 1
        elif status is EntryStatus.CANCELLED:
            out.cancelled += 1
        else:
            out.failed += 1
        device = device_of_meta(meta)
        if device is not None and (entry is not None or running):
            counts = out.devices.setdefault(device, {"done": 0, "running": 0})
            counts["running" if running else "done"] += 1
    return out


class JobHandle(Generic[K, R]):
    """What fan-outs, sweeps and studies share (see the module's docstring).

    A subclass names its jobs (:meth:`jobs`), its blocking :meth:`get` and :meth:`cancel`, and
    how the awaited result is made of the finished jobs' metas (:meth:`_result`).
    """

    #: ``progress()`` has every job (``{}`` until it reports) rather than the running ones.
    progress_of_every_job = True

    def __init__(self, app: Celery, connections: Connections | None = None,
                 reader: StateReader | None = None) -> None:
        self.app = app
        self.connections = connections or Connections.of(app)
        self.reader = reader or StateReader(self.connections)

    def drop_connections(self) -> None:
        """Disconnect the Redis connections this handle reads with; each reconnects when next
        used. For after an interrupt (Ctrl-C's ``KeyboardInterrupt``), which may have come between
        one of its commands and the reply: redis-py leaves the reply unread in a connection it
        hands back to its pool, for the next command to read as its own. The CLI calls this
        before it cancels."""
        drop = getattr(self.app, "drop_connections", None)  # a FleetCelery's result backends
        if drop is not None:
            drop()
        self.connections.drop()

    # -- what a subclass says ---------------------------------------------------------------------

    def jobs(self) -> dict[K, str]:
        """``{key: Celery task id}`` of every job, in order."""
        raise NotImplementedError

    @property
    def devices(self) -> list[str]:
        raise NotImplementedError

    def get(self, timeout: float | None = None) -> R:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def _result(self, metas: Mapping[str, Meta | None]) -> R:
        """The result, made of every job's final meta."""
        raise NotImplementedError

    def _advance(self, metas: Mapping[str, Meta | None]) -> bool:
        """Called (blocking) with each read: a sweep sends more trials here. True: read again."""
        return False

    def _advance_due(self, metas: Mapping[str, Meta | None]) -> bool:
        """Whether :meth:`_advance` has anything to do now (an awaiting reader runs it then, in
        a thread)."""
        return False

    def _device_of(self, meta: Meta | None) -> str | None:
        return device_of(meta)

    def _name(self, key: K) -> str:
        return str(key)

    # -- reading: one implementation, blocking and awaited -----------------------------------------

    def _read(self) -> dict[str, Meta | None]:
        ids = list(self.jobs().values())
        metas = self.reader.metas(ids)
        if self._advance(metas):
            metas = self.reader.metas(ids)
        return metas

    async def _aread(self, metas: dict[str, Meta | None] | None = None) -> dict[str, Meta | None]:
        ids = list(self.jobs().values())
        if metas is None:
            metas = await self.reader.ametas(ids)
        if self._advance_due(metas) and await asyncio.to_thread(self._advance, metas):
            metas = await self.reader.ametas(ids)
        return metas

    def _states(self, metas: Mapping[str, Meta | None]) -> dict[K, str]:
        return {key: state_of(metas.get(tid)) for key, tid in self.jobs().items()}

    def _progress_ids(self, metas: Mapping[str, Meta | None]) -> list[str]:
        ids = self.jobs().values()
        if self.progress_of_every_job:
            return list(ids)
        return [tid for tid in ids if state_of(metas.get(tid)) in RUNNING_STATES]

    def _progress(self, metas: Mapping[str, Meta | None], reports: Mapping[str, dict[str, Any]]
                  ) -> dict[K, dict[str, Any]]:
        if self.progress_of_every_job:
            return {key: reports.get(tid, {}) for key, tid in self.jobs().items()}
        running = set(self._progress_ids(metas))
        return {key: reports[tid] for key, tid in self.jobs().items() if tid in running and tid in reports}

    def _summary(self, metas: Mapping[str, Meta | None]) -> Summary:
        return summarize((metas.get(tid) for tid in self.jobs().values()), self.devices, self._device_of)

    def _all_final(self, metas: Mapping[str, Meta | None]) -> bool:
        return all(entry_of(metas.get(tid)) is not None for tid in self.jobs().values())

    def states(self) -> dict[K, str] | list[str]:
        """Each job's Celery state (``PENDING`` until a device takes it): one read for all;
        ``{key: state}`` (a sweep: a list in trial order, see the module's docstring)."""
        return self._states_view(self._states(self._read()))

    async def astates(self) -> dict[K, str] | list[str]:
        return self._states_view(self._states(await self._aread()))

    def _states_view(self, states: dict[K, str]) -> dict[K, str] | list[str]:
        """What :meth:`states` and :meth:`astates` return of ``{key: state}``: itself here."""
        return states

    def progress(self) -> dict[K, dict[str, Any]]:
        """Each job's latest progress report (see :attr:`progress_of_every_job`)."""
        metas = self._read()
        return self._progress(metas, self.reader.reports(self._progress_ids(metas)))

    async def aprogress(self) -> dict[K, dict[str, Any]]:
        metas = await self._aread()
        return self._progress(metas, await self.reader.areports(self._progress_ids(metas)))

    def summary(self) -> Summary:
        """How many jobs are done, failed, cancelled, running and queued, and where."""
        return self._summary(self._read())

    async def asummary(self) -> Summary:
        return self._summary(await self._aread())

    def ready(self) -> bool:
        """Whether every job has finished (ok, failed or cancelled)."""
        return self._all_final(self._read())

    async def aready(self) -> bool:
        return self._all_final(await self._aread())

    async def acancel(self) -> None:
        """:meth:`cancel`, from async code (Celery's revoke is a blocking publish: a thread)."""
        await asyncio.to_thread(self.cancel)

    # -- awaiting ---------------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, R]:
        return self.wait().__await__()

    async def wait(self, timeout: float | None = None, *, cancel: bool = False) -> R:
        """The result, as :meth:`get` returns it, without blocking the event loop.

        Args:
            timeout: seconds to wait; then :class:`FanOutTimeout`, the jobs go on.
            cancel: if the awaiting task is cancelled, cancel the jobs too (default: they go on,
                and this handle or another producer can still collect them).

        Raises:
            FanOutTimeout: ``timeout`` seconds passed first.
        """
        try:
            async with asyncio.timeout(timeout):
                return await self._wait()
        except TimeoutError:
            pending = [self._name(k) for k, s in self._states(await self._aread()).items()
                       if s not in states.READY_STATES]
            raise FanOutTimeout(timeout or 0.0, pending) from None
        except asyncio.CancelledError:
            if cancel:
                logger.info("%r: the awaiting task was cancelled; cancelling its jobs", self)
                await asyncio.shield(self.acancel())
            raise

    async def _wait(self) -> R:
        async for metas, _heard in self._follow():
            if self._all_final(metas):
                return self._result(metas)
        raise AssertionError("unreachable: _follow ends only when its consumer stops")

    async def _follow(self, ordered: bool = False
                      ) -> AsyncIterator[tuple[dict[str, Meta | None], list[tuple[str, Meta]]]]:
        """``(every job's meta, the states heard since the last yield)`` after each change: first
        the stored metas, then at each state published. A job that joins the handle (a study's
        next trial) is heard from then on and read once. With ``ordered``, what is heard also
        holds each new job's stored meta, in its place among the states published before it was
        read (a barrier), so that :meth:`watch` reports in order."""
        listener = self.connections.listener()
        followed: set[str] = set()
        heard: list[tuple[str, Meta]] = []
        metas: dict[str, Meta | None] | None = None
        async with listener.subscribe(()) as sub:
            while True:
                new: list[str] = []
                while more := [tid for tid in self.jobs().values() if tid not in followed]:
                    await listener.extend(sub, more)  # subscribed first: nothing stored after is missed
                    followed.update(more)
                    new += more
                    metas = await self._aread()  # may add jobs (a study asks for its next trials)
                if metas is None:  # no job yet
                    metas = await self._aread()
                if ordered and new:
                    await listener.barrier()
                    later = sub.drain()
                    told = {tid for tid, _ in later}
                    # A job heard from since it was read: its messages say it all, in order.
                    snapshot = [(tid, m) for tid in new if (m := metas.get(tid)) is not None and tid not in told]
                    heard = [*heard, *snapshot, *later]
                yield metas, heard
                message = await sub.next(RECHECK_S)
                if message is None:  # nothing heard for a while: read what is stored
                    metas, heard = await self._aread(), []
                else:
                    heard = [message, *sub.drain()]
                    for task_id, meta in heard:
                        self.reader.note(task_id, meta)
                    metas = await self._aread({tid: self.reader.known(tid) for tid in self.jobs().values()})

    async def watch(self) -> AsyncIterator[Report[K]]:
        """Each job's state and progress as it is published, in order, until every job has
        finished: a :class:`Report` per change (``STARTED``, each ``PROGRESS`` report, the final
        state with the entry). A job's last progress report comes before its final state."""
        key_of: dict[str, K] = {}
        progress: dict[str, dict[str, Any]] = {}
        last: dict[str, tuple[str, Any]] = {}
        async for metas, heard in self._follow(ordered=True):
            new = [tid for tid in self.jobs().values() if tid not in key_of]
            if new:
                key_of.update({tid: key for key, tid in self.jobs().items()})
                progress.update(await self.reader.areports(new))
            events = heard or [(tid, m) for tid, m in metas.items() if m is not None]
            for task_id, meta in events:
                state = state_of(meta)
                if task_id in last and last[task_id][0] in states.READY_STATES:
                    continue
                if state == PROGRESS_STATE and isinstance(meta.get("result"), dict):
                    progress[task_id] = meta["result"]
                seen = (state, progress.get(task_id))
                if last.get(task_id) == seen:
                    continue
                last[task_id] = seen
                yield Report(key_of[task_id], task_id, state, dict(progress.get(task_id) or {}), entry_of(meta))
            if self._all_final(metas):
                return

    # -- blocking: a poll that backs off ----------------------------------------------------------

    def _poll_until_final(self, timeout: float | None, stop: threading.Event | None = None) -> R:
        """The result, read blocking (each read advances the handle): every :data:`MIN_POLL_S`
        while jobs finish, backing off to :data:`MAX_POLL_S` while nothing changes. ``stop``:
        an event that ends the wait early (then the result as it stands).

        Raises:
            FanOutTimeout: ``timeout`` seconds passed first; the jobs go on.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, finished = MIN_POLL_S, -1
        while True:
            metas = self._read()
            if self._all_final(metas) or (stop is not None and stop.is_set()):
                return self._result(metas)
            if deadline is not None and time.monotonic() > deadline:
                pending = [self._name(k) for k, s in self._states(metas).items() if s not in states.READY_STATES]
                raise FanOutTimeout(timeout or 0.0, pending)
            now_finished = sum(1 for tid in self.jobs().values() if entry_of(metas.get(tid)) is not None)
            pause = MIN_POLL_S if now_finished != finished else min(MAX_POLL_S, pause * 2)
            finished = now_finished
            if stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)
