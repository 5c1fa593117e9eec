"""A producer's Redis connections, owned by one object and closed with it.

A producer reads the registry and its jobs' progress with redis-py, and waits for results with
redis-py's asyncio client (:mod:`redis.asyncio`) and one pub/sub connection
(:class:`~tasks.producer.listener.StateListener`). :class:`Connections` holds them:

- the blocking client (``.redis``), made when first used;
- per event loop, the asyncio client and the listener (a ``redis.asyncio`` connection belongs to
  the loop it was made in; a client used from a second ``asyncio.run`` makes new ones);
- ``close()`` / ``aclose()`` close them, and ``with`` / ``async with`` do it for you; a loop
  that ``asyncio.run`` ends closes its own as it cancels the tasks left.

Handles keep the connections they were made with. A call that names none
(``tasks.fan_out(...)`` without ``client=``) uses its app's default connections
(:meth:`Connections.of`), which are closed with the app (``app.close()``) or when it is
garbage-collected.

Celery's own result consumer and broker pool are Celery's: these are the fleet's reads beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis
from celery import Celery

from ..core.app import redis_url_of
from ..core.registry import connect, connect_async
from ..core.sentinel import disconnect_pool
from ..core.users import denial

if TYPE_CHECKING:
    from .listener import StateListener

logger = logging.getLogger(__name__)

#: The name a producer's connections give themselves (``CLIENT LIST`` in redis-cli shows it).
CLIENT_NAME = "devicefleet-producer"
#: The attribute of an app that holds its default connections (:meth:`Connections.of`): the app
#: owns them, so that nothing outside it keeps the app alive.
DEFAULT_CONNECTIONS_ATTR = "_fleet_connections"


class _Client:
    """The blocking client of one :class:`Connections`, closable without them: what a finalizer
    of the app holds (holding the connections, which hold the app, would keep the app alive)."""

    def __init__(self) -> None:
        self.redis: redis.Redis | None = None

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
            self.redis = None


def default_app() -> Celery:
    """``tasks.app``, the app a call that names none sends through."""
    from ..core.app import app

    return app


class Connections:
    """The Redis connections of one producer (see the module's docstring).

    Args:
        app: the Celery app whose fleet to talk to; default ``tasks.app``.
    """

    def __init__(self, app: Celery | None = None) -> None:
        self.app = app or default_app()
        self._client = _Client()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aio: aioredis.Redis | None = None
        self._listener: StateListener | None = None
        self._keeper: asyncio.Task[None] | None = None
        self.closed = False

    @classmethod
    def of(cls, app: Celery | None = None) -> Connections:
        """The default connections of ``app`` (default ``tasks.app``): made once per app, closed
        with it (a :class:`~tasks.core.app.FleetCelery`'s ``close()``) or when it is collected."""
        app = app or default_app()
        found: Connections | None = getattr(app, DEFAULT_CONNECTIONS_ATTR, None)
        if found is None or found.closed:
            found = cls(app)
            setattr(app, DEFAULT_CONNECTIONS_ATTR, found)
            weakref.finalize(app, found._client.close)
            on_close = getattr(app, "on_close", None)
            if on_close is not None:
                on_close(found.close)
        return found

    @property
    def url(self) -> str:
        return redis_url_of(self.app)

    @property
    def redis(self) -> redis.Redis:
        """The blocking client (``str`` replies), for the registry and progress reads."""
        if self._client.redis is None:
            client = connect(self.url)
            # Named on each connection the pool opens (tasks.core.registry.connect makes the pool).
            client.connection_pool.connection_kwargs["client_name"] = CLIENT_NAME
            settings = getattr(self.app, "fleet_settings", None)
            credentials = settings.user_credentials if settings is not None else None
            if credentials is not None:  # a user's: wrong or revoked ones fail here, in one line
                try:
                    client.ping()
                except redis.exceptions.RedisError as exc:
                    client.close()
                    refused = denial(exc, credentials.user)
                    if refused is None:
                        raise
                    raise refused from None
            self._client.redis = client
        return self._client.redis

    # -- asyncio --------------------------------------------------------------------------------

    def _for_this_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # Another loop's client cannot be awaited here; its loop closed it as it ended.
            self._aio, self._listener, self._keeper, self._loop = None, None, None, loop

    def aio(self) -> aioredis.Redis:
        """The asyncio client of the running loop (``bytes`` replies, as Celery's keys are)."""
        self._for_this_loop()
        if self._aio is None:
            self._aio = connect_async(self.url, client_name=CLIENT_NAME)
            self._keeper = asyncio.get_running_loop().create_task(self._close_with_loop(),
                                                                  name="devicefleet-connections")
        return self._aio

    async def _close_with_loop(self) -> None:
        """Wait until cancelled (by :meth:`aclose`, or by ``asyncio.run`` as its loop ends, which
        cancels every task left), then close the loop's client and listener."""
        try:
            await asyncio.Event().wait()
        finally:
            listener, aio = self._listener, self._aio
            self._listener = self._aio = None
            if listener is not None:
                await listener.aclose()
            if aio is not None:
                await aio.aclose()

    def listener(self) -> StateListener:
        """The running loop's pub/sub listener for task states (one connection for every wait)."""
        from .listener import StateListener

        self._for_this_loop()
        if self._listener is None:
            self._listener = StateListener(self.aio(), self.app.backend)
        return self._listener

    # -- closing --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the running loop's asyncio client and listener (the blocking client stays)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None and self._loop is asyncio.get_running_loop():
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    def drop(self) -> None:
        """Disconnect the blocking client's connections; it reconnects when next used (after an
        interrupt, as :meth:`tasks.core.app.FleetCelery.drop_connections`)."""
        if self._client.redis is not None:
            disconnect_pool(self._client.redis.connection_pool)

    def close(self) -> None:
        """Close the blocking client; the asyncio ones are dropped (use :meth:`aclose` inside the
        loop to close them cleanly)."""
        self.closed = True
        self._client.close()
        self._listener = self._aio = None

    def __enter__(self) -> Connections:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
        self.close()
