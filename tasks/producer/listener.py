"""Task states as they are stored: one ``redis.asyncio`` pub/sub connection for every awaiting handle.

Celery's Redis backend publishes every state it stores on a channel named by the task's meta key
(``celery-task-meta-<id>``: ``RedisBackend._set``, and read by its ``ResultConsumer``); the
fleet's backend does the same from its store script (:data:`tasks.core.jobscripts.LUA_STATE_FUNCTIONS`),
for STARTED, every PROGRESS report and the final state. A :class:`StateListener` subscribes to
the channels its waiters ask for, reads them in one task and hands each waiter the decoded meta.

``async with listener.subscribe(task_ids) as sub`` returns once Redis has confirmed the
subscription, so a state stored after that is never missed: read the stored metas then, and
take what changed from ``await sub.next()``. ``await listener.barrier()`` returns once every
message published before it was called has been handed out (a PING on the pub/sub connection:
Redis answers it after every message it sent there before), which puts a stored state read in
its place among the messages (:meth:`tasks.producer.handle.JobHandle.watch`). Pub/sub is at most once (a message sent while the
connection is re-established is lost), so a waiter that hears nothing for a while reads the
stored metas again (:data:`RECHECK_S`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis.asyncio as aioredis

from ..core.defaults import LISTENER_CONFIRM_S as CONFIRM_S
from ..core.defaults import LISTENER_RECHECK_S as RECHECK_S
from ..core.defaults import LISTENER_RETRY_S as RETRY_S

logger = logging.getLogger(__name__)

#: The PING payload of :meth:`StateListener.barrier` (redis-py's own health check sends another).
BARRIER = b"devicefleet-barrier"


class Subscription:
    """What one waiter hears: ``(task id, meta)`` for each state stored after it subscribed."""

    def __init__(self, channels: dict[bytes, str]) -> None:
        self.channels = channels
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

    async def next(self, timeout: float | None = RECHECK_S) -> tuple[str, dict[str, Any]] | None:
        """The next state stored, or None after ``timeout`` seconds without one."""
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return None

    def drain(self) -> list[tuple[str, dict[str, Any]]]:
        """Every state already heard, without waiting."""
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out


class StateListener:
    """One pub/sub connection and the task that reads it (see the module's docstring).

    Args:
        client: the running loop's ``redis.asyncio`` client of the fleet.
        backend: the app's result backend: its key names and its decoder.
    """

    def __init__(self, client: aioredis.Redis, backend: Any) -> None:
        self.backend = backend
        self._pubsub = client.pubsub()
        self._waiters: dict[bytes, set[Subscription]] = {}
        self._subscribed: dict[bytes, asyncio.Future[None]] = {}
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._pongs: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    def channel(self, task_id: str) -> bytes:
        """The channel (and key) of ``task_id``'s state: Celery's ``get_key_for_task``."""
        key = self.backend.get_key_for_task(task_id)
        return key if isinstance(key, bytes) else str(key).encode()

    @contextlib.asynccontextmanager
    async def subscribe(self, task_ids: Iterable[str]) -> AsyncIterator[Subscription]:
        """Hear the states of ``task_ids`` from when Redis confirms the subscription (more jobs
        join it with :meth:`extend`)."""
        sub = Subscription({})
        try:
            await self.extend(sub, task_ids)
            yield sub
        finally:
            for channel in sub.channels:
                waiters = self._waiters.get(channel)
                if waiters is not None:
                    waiters.discard(sub)
                    if not waiters:
                        del self._waiters[channel]
            if not self._closed:
                await self._unsubscribe_unwatched()

    async def extend(self, sub: Subscription, task_ids: Iterable[str]) -> None:
        """Hear the states of ``task_ids`` too on ``sub`` (a study's new trials), from when Redis
        confirms the subscription."""
        channels = {self.channel(task_id): task_id for task_id in task_ids}
        sub.channels.update(channels)
        for channel in channels:
            self._waiters.setdefault(channel, set()).add(sub)
        async with self._lock:
            new = [c for c in channels if c not in self._subscribed]
            if new:
                loop = asyncio.get_running_loop()
                self._subscribed.update({c: loop.create_future() for c in new})
                await self._pubsub.subscribe(*new)
                self._start_reader()
        confirmations = [self._subscribed[c] for c in channels if c in self._subscribed]
        try:
            async with asyncio.timeout(CONFIRM_S):
                await asyncio.gather(*(asyncio.shield(f) for f in confirmations))
        except TimeoutError:
            logger.warning("no subscribe confirmation from Redis in %g s; reading on", CONFIRM_S)

    async def barrier(self) -> None:
        """Return once every message Redis published before this call has been dispatched."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        async with self._lock:  # the PINGs go out in the order their futures are queued
            self._pongs.append(future)
            await self._pubsub.ping(BARRIER)
            self._start_reader()
        try:
            async with asyncio.timeout(CONFIRM_S):
                await asyncio.shield(future)
        except TimeoutError:
            logger.warning("no PONG from Redis in %g s; reading on", CONFIRM_S)

    async def _unsubscribe_unwatched(self) -> None:
        async with self._lock:
            gone = [c for c in self._subscribed if c not in self._waiters]
            for channel in gone:
                future = self._subscribed.pop(channel)
                if not future.done():
                    future.cancel()
            if gone:
                try:
                    await self._pubsub.unsubscribe(*gone)
                except Exception as exc:  # noqa: BLE001  (a dropped connection dropped them too)
                    logger.debug("unsubscribe failed: %s", exc)

    def _start_reader(self) -> None:
        """Read the pub/sub connection, from a task. Called once a SUBSCRIBE or PING has gone
        out on it: before that redis-py has no connection to read ("pubsub connection not
        set"), as when a waiter subscribes to no job yet (:meth:`JobHandle._follow` does)."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="devicefleet-state-listener")

    async def _read(self) -> None:
        while not self._closed:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (redis-py retried; waiters re-read meanwhile)
                logger.warning("state listener: %s; trying again in %g s", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message.get("channel")
        if not isinstance(channel, bytes):
            channel = str(channel).encode()
        kind = message.get("type")
        if kind == "subscribe":
            future = self._subscribed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
            return
        if kind == "pong":
            if message.get("data") == BARRIER and self._pongs:
                future = self._pongs.popleft()
                if not future.done():
                    future.set_result(None)
            return
        if kind != "message":
            return
        waiters = self._waiters.get(channel)
        if not waiters:
            return
        try:
            meta = self.backend.decode(message["data"])
        except Exception as exc:  # noqa: BLE001  (a malformed state reads as not there)
            logger.debug("undecodable state on %r: %s", channel, exc)
            return
        if not isinstance(meta, dict):
            return
        for sub in list(waiters):
            sub.queue.put_nowait((sub.channels[channel], meta))

    async def aclose(self) -> None:
        """Stop reading and close the pub/sub connection."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await self._pubsub.aclose()
