"""Redis Sentinel: the URL form that names a fleet's sentinels, and what each client needs of it.

A fleet on Sentinel has one primary, replicas, and sentinels that promote a replica when the
primary dies. ``DEVICEFLEET_REDIS_URL`` names the sentinels, the master's name, and the
passwords of Redis and of the sentinels, in one URL::

    sentinel://:REDIS_PASSWORD@10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/0?master_name=devicefleet&sentinel_password=SENTINEL_PASSWORD

kombu's and Celery's own form, one ``sentinel://`` per sentinel joined by ``;``, is accepted
too (the query may follow any of them). The options kombu and Celery take apart from the URL
(``master_name`` and ``sentinel_kwargs`` as transport options: celery PR #6551, "No master
found" when the sentinels' password is missing) are made here, from the one URL:

- the broker and the result backend: :meth:`SentinelURL.kombu_url` and
  :meth:`SentinelURL.transport_options` (kombu's ``SentinelChannel``, Celery's
  ``SentinelBackend``, which ask every sentinel in turn: kombu PR #813);
- the fleet's own clients (registry, leases, sweeps, Optuna's journal): :meth:`SentinelURL.client`,
  a redis-py ``Sentinel.master_for`` client whose connections ask the sentinels where the
  primary is and treat ``READONLY`` from a demoted primary as a lost connection.

Redis Cluster is another thing (kombu does not support it: celery#2852) and is not accepted.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from .defaults import FAILOVER_BACKOFF_S, FAILOVER_RETRIES, REDIS_WAIT_TIMEOUT_MS, SENTINEL_PROBE_TIMEOUT_S

if TYPE_CHECKING:
    import redis.asyncio

logger = logging.getLogger(__name__)

SCHEME = "sentinel"
DEFAULT_PORT = 26379
#: The options a Sentinel URL's query may carry; anything else is refused (a typo would
#: otherwise reach redis-py as an unknown connection argument).
QUERY_OPTIONS = ("master_name", "sentinel_password", "sentinel_username")
#: The sentinels' password in a URL's query, for :func:`redact`.
_PASSWORD_OPTION = re.compile(r"((?:^|&)sentinel_password=)[^&]*")


class SentinelPrimary(redis.Redis):
    """The primary's client (:meth:`SentinelURL.client`): closing it also closes its sentinels'
    connections, which redis-py's ``Sentinel`` keeps in clients of their own that nothing else
    closes (they were left to the garbage collector, one ``ResourceWarning`` each)."""

    def close(self) -> None:
        super().close()
        for sentinel in _sentinels_of(self.connection_pool):
            sentinel.close()


def _sentinels_of(pool: Any) -> list[Any]:
    """The sentinels' clients of a ``master_for`` pool (its ``sentinel_manager``)."""
    manager = getattr(pool, "sentinel_manager", None)
    return list(manager.sentinels) if manager is not None else []


def disconnect_pool(pool: Any) -> None:
    """Disconnect every connection of ``pool`` and, for a ``master_for`` pool, of the sentinels'
    clients it asks (as :class:`SentinelPrimary` closes them). Each reconnects when next used.
    For a pool made by another library (Celery's Sentinel result backend)."""
    pool.disconnect()
    for sentinel in _sentinels_of(pool):
        sentinel.connection_pool.disconnect()


def _async_primary_class() -> type[redis.asyncio.Redis]:
    """:class:`SentinelPrimary` for :mod:`redis.asyncio` (made when first asked: ``import
    redis.asyncio`` loads asyncio, which a worker never needs)."""
    global _AsyncSentinelPrimary
    if _AsyncSentinelPrimary is None:
        from redis.asyncio import Redis as AsyncRedis

        class AsyncSentinelPrimary(AsyncRedis):
            __doc__ = SentinelPrimary.__doc__

            async def aclose(self, close_connection_pool: bool | None = None) -> None:
                await super().aclose(close_connection_pool)
                for sentinel in _sentinels_of(self.connection_pool):
                    await sentinel.aclose()

        _AsyncSentinelPrimary = AsyncSentinelPrimary
    return _AsyncSentinelPrimary


_AsyncSentinelPrimary: type[redis.asyncio.Redis] | None = None


class ReadOnlyAwareConnection(SentinelManagedConnection):
    """redis-py's Sentinel-managed connection, which turns ``READONLY`` from a primary that was
    demoted into a lost connection (the next try asks the sentinels for the new primary), also
    when the write was inside a Lua script: Redis 6 reports that as ``ERR Error running script
    ... -READONLY ...``, which redis-py parses as a plain ``ResponseError``. ``NOREPLICAS`` (a
    primary with ``min-replicas-to-write`` whose replicas are not there yet) is taken the same way.

    It also asks the sentinels again on each try of a reconnect. redis-py 8.1's
    ``send_packed_command`` reconnects a dropped connection through ``connect_check_health``,
    which retries the address the connection had, not ``connect()``, which asks the sentinels:
    a connection that lost the killed primary in the middle of a command kept dialling it for
    its whole retry budget (40 s with the fleet's) while the others had moved to the new one.
    """

    # redis-py internals: Connection.connect_check_health(check_health, retry_socket_connect)
    # and SentinelManagedConnection._connect_retry / connect_to (redis-py 8.1).
    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> Any:
        if self._sock or not retry_socket_connect:
            return super().connect_check_health(check_health=check_health, retry_socket_connect=False)
        return self.retry.call_with_retry(self._connect_retry, lambda error: self.disconnect())

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not self.connection_pool.is_master:
                raise
            if "READONLY" in str(exc):
                self.disconnect()
                raise RedisConnectionError(f"the primary was demoted ({exc}); asking the sentinels again") from exc
            if "NOREPLICAS" in str(exc):
                # min-replicas-to-write: a primary just promoted, whose replicas have not
                # followed it yet (or one cut off from them), takes no writes for now. Retried as
                # a lost connection is, not an error: kombu's consumer took it for one and the
                # worker exited, a few seconds after a failover.
                self.disconnect()
                raise RedisConnectionError(f"the primary takes no writes now ({exc}); trying again") from exc
            raise


@dataclass(frozen=True)
class SentinelURL:
    """A parsed Sentinel URL (see the module's docstring)."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        """Parse either form of a Sentinel URL.

        Raises:
            ValueError: not a Sentinel URL, or a part is missing or malformed; the message names
                the part (the caller names the URL, with :func:`redact`).
        """
        hosts: list[tuple[str, int]] = []
        users: set[tuple[str | None, str | None]] = set()
        dbs: set[int] = set()
        query: dict[str, str] = {}
        for chunk in url.split(";"):
            parts = urlsplit(chunk.strip())
            if parts.scheme != SCHEME:
                raise ValueError(f"each part must start with {SCHEME}://, got {chunk.split('://')[0]!r}")
            userinfo, _, netloc = parts.netloc.rpartition("@")
            if userinfo:
                user, _, secret = userinfo.partition(":")
                users.add((unquote(user) or None, unquote(secret) or None))
            for address in netloc.split(","):
                hosts.append(_host_port(address))
            path = parts.path.strip("/")
            if path:
                if not path.isdigit():
                    raise ValueError(f"the database must be a number, got {path!r}")
                dbs.add(int(path))
            for key, value in parse_qsl(parts.query, keep_blank_values=True):
                if key not in QUERY_OPTIONS:
                    raise ValueError(f"unknown option {key!r}; a Sentinel URL takes "
                                     f"{', '.join(QUERY_OPTIONS)}")
                query[key] = value
        if len(users) > 1 or len(dbs) > 1:
            raise ValueError("every sentinel must name the same Redis password and database")
        master = query.get("master_name", "")
        if not master:
            raise ValueError("no master_name: add ?master_name=NAME, the name the "
                             "sentinels monitor the primary under (`sentinel monitor NAME ...`)")
        if len(set(hosts)) != len(hosts):
            raise ValueError("a sentinel is named twice")
        username, password = next(iter(users), (None, None))
        return cls(sentinels=tuple(hosts), master_name=master, db=next(iter(dbs), 0),
                   username=username, password=password,
                   sentinel_username=query.get("sentinel_username") or None,
                   sentinel_password=query.get("sentinel_password") or None)

    def to_url(self) -> str:
        """The one-URL form, with every sentinel."""
        hosts = ",".join(_join(host, port) for host, port in self.sentinels)
        query = urlencode({"master_name": self.master_name,
                           **({"sentinel_username": self.sentinel_username} if self.sentinel_username else {}),
                           **({"sentinel_password": self.sentinel_password} if self.sentinel_password else {})})
        return f"{SCHEME}://{self._userinfo()}{hosts}/{self.db}?{query}"

    def kombu_url(self) -> str:
        """kombu's and Celery's form: ``sentinel://:PASSWORD@host:port/db`` per sentinel, joined
        by ``;`` (options apart: :meth:`transport_options`)."""
        return ";".join(f"{SCHEME}://{self._userinfo()}{_join(host, port)}/{self.db}" for host, port in self.sentinels)

    def transport_options(self) -> dict[str, Any]:
        """What kombu's ``SentinelChannel`` and Celery's ``SentinelBackend`` take beside the URL:
        the master's name and how to log in to the sentinels (``sentinel_kwargs``)."""
        options: dict[str, Any] = {"master_name": self.master_name}
        sentinel_kwargs = self.sentinel_kwargs()
        if sentinel_kwargs:
            options["sentinel_kwargs"] = sentinel_kwargs
        return options

    def sentinel_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sentinel_password:
            out["password"] = self.sentinel_password
        if self.sentinel_username:
            out["username"] = self.sentinel_username
        return out

    def client(self, *, decode_responses: bool = True, **kwargs: Any) -> redis.Redis:
        """A redis-py client of the current primary: each connection asks the sentinels where it
        is, ``READONLY`` sends it to ask again, and a command retries through a failover
        (:data:`FAILOVER_RETRIES`)."""
        sentinel = Sentinel(list(self.sentinels), sentinel_kwargs=self._asking(kwargs, Retry(NoBackoff(), 0)))
        retry = Retry(ExponentialBackoff(cap=FAILOVER_BACKOFF_S[1], base=FAILOVER_BACKOFF_S[0]), FAILOVER_RETRIES,
                      supported_errors=(RedisConnectionError, RedisTimeoutError, ConnectionResetError))
        return sentinel.master_for(self.master_name, redis_class=SentinelPrimary, connection_class=ReadOnlyAwareConnection,
                                   decode_responses=decode_responses, **self._primary(retry), **kwargs)

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        """The same for :mod:`redis.asyncio` (a producer's awaited reads and its pub/sub
        listener): a ``redis.asyncio`` Sentinel ``master_for`` client whose connections ask the
        sentinels where the primary is on every reconnect, retrying through a failover. It only
        reads and listens, so a demoted primary's ``READONLY`` cannot reach it."""
        from redis.asyncio.retry import Retry as AsyncRetry
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        sentinel = AsyncSentinel(list(self.sentinels), sentinel_kwargs=self._asking(kwargs, AsyncRetry(NoBackoff(), 0)))
        retry = AsyncRetry(ExponentialBackoff(cap=FAILOVER_BACKOFF_S[1], base=FAILOVER_BACKOFF_S[0]), FAILOVER_RETRIES,
                           supported_errors=(RedisConnectionError, RedisTimeoutError))
        return sentinel.master_for(self.master_name, redis_class=_async_primary_class(), **self._primary(retry),
                                   **kwargs)

    def problem(self, timeout_s: float = SENTINEL_PROBE_TIMEOUT_S) -> str | None:
        """Why no client could find the primary now, asking each sentinel once (no retry), or
        ``None`` when one names it. For the edges (``devicefleet status``, a worker's start): a
        wrong address, port, password or master name is said at once, where the clients would
        retry for a failover's length (:data:`FAILOVER_RETRIES`) and then report redis-py's
        objects. A failover in progress (the sentinels answer, none names a primary yet) is no
        problem here: the clients wait it out."""
        said: list[str] = []
        for host, port in self.sentinels:
            client = self.sentinel_client(host, port, timeout_s)
            try:
                if client.execute_command("SENTINEL", "get-master-addr-by-name", self.master_name):
                    return None
                said.append(f"{_join(host, port)} monitors no master_name={self.master_name!r}")
            except ResponseError as exc:
                said.append(f"{_join(host, port)} refused: {exc}")
            except redis.RedisError as exc:
                said.append(f"{_join(host, port)}: {exc}")
            finally:
                client.close()
        return "no sentinel names a primary: " + "; ".join(said)

    def replicas(self, timeout_s: float = SENTINEL_PROBE_TIMEOUT_S) -> list[tuple[str, int]]:
        """The primary's replicas, as the first sentinel that answers lists them (``SENTINEL
        REPLICAS``; those it flags down or disconnected left out); empty when none answers."""
        for host, port in self.sentinels:
            client = self.sentinel_client(host, port, timeout_s)
            try:
                listed = client.execute_command("SENTINEL", "REPLICAS", self.master_name)
            except redis.RedisError:
                continue
            finally:
                client.close()
            out = []
            for entry in listed:
                fields = dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else dict(entry)
                flags = str(fields.get("flags", ""))
                if not any(flag in flags for flag in ("s_down", "o_down", "disconnected")):
                    out.append((str(fields["ip"]), int(fields["port"])))
            return out
        return []

    def sentinel_client(self, host: str, port: int, timeout_s: float = SENTINEL_PROBE_TIMEOUT_S) -> redis.Redis:
        """A client of the sentinel at ``host:port``, with this URL's login to the sentinels and
        no retry (the caller asks the next one)."""
        return redis.Redis(host=host, port=port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                           retry=Retry(NoBackoff(), 0), decode_responses=True, **self.sentinel_kwargs())

    def node_client(self, host: str, port: int, timeout_s: float = SENTINEL_PROBE_TIMEOUT_S) -> redis.Redis:
        """A client of the Redis at ``host:port`` (a replica), with this URL's login, no retry."""
        return redis.Redis(host=host, port=port, db=self.db, username=self.username, password=self.password,
                           socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                           retry=Retry(NoBackoff(), 0), decode_responses=True)

    def _primary(self, retry: Any) -> dict[str, Any]:
        """What the primary's connections take, blocking or asyncio: the database, the login, and
        ``retry`` (through a failover) on a lost connection or a timeout."""
        return {"db": self.db, "username": self.username, "password": self.password, "retry": retry,
                "retry_on_error": [RedisConnectionError, RedisTimeoutError]}

    def _asking(self, kwargs: dict[str, Any], retry: Any) -> dict[str, Any]:
        """How the fleet's own clients talk to the sentinels: their login, the connect and read
        timeouts of ``kwargs``, and no retry of a sentinel that does not answer (the next one is
        asked instead: with redis-py 8.1's default retries, a new client spent 4 s on a dead
        first sentinel before asking the second)."""
        timeouts: dict[str, Any] = {key: kwargs[key] for key in ("socket_connect_timeout", "socket_timeout")
                                    if key in kwargs}
        return {**self.sentinel_kwargs(), **timeouts, "retry": retry}

    def check_auth(self) -> None:
        """Refuse sentinels on other hosts without both passwords: anyone who reaches a sentinel
        with none can make it fail over or point the fleet at a Redis of theirs.

        Raises:
            ValueError: a sentinel is not on loopback and a password is missing.
        """
        remote = [host for host, _ in self.sentinels if not is_loopback(host)]
        if not remote:
            return
        missing = [name for name, value in (("the Redis password (sentinel://:PASSWORD@...)", self.password),
                                            ("sentinel_password=...", self.sentinel_password)) if not value]
        if missing:
            raise ValueError(f"the URL reaches sentinels on {', '.join(remote)}, which are not loopback, "
                             f"without {' and '.join(missing)}: set both in the URL, and requirepass "
                             "(and masterauth) in Redis and the sentinels")

    def _userinfo(self) -> str:
        if not self.password and not self.username:
            return ""
        return f"{quote(self.username or '', safe='')}:{quote(self.password or '', safe='')}@"


@dataclass(frozen=True)
class Replication:
    """How many replicas must have a write before the fleet goes on from it (Redis's ``WAIT``),
    and for how long at most; ``replicas=0`` waits for none (a single Redis).

    Redis replicates asynchronously: a write the primary acknowledged can be lost when it dies,
    or is cut off from its replicas and sentinels, before a replica has it (Sentinel promotes
    the replica with the most data; Jepsen's Redis analysis, 2013). ``WAIT`` after the writes
    that matter (a job's lease taken or renewed, its result stored, a message published, an
    Optuna journal entry) tells which of them a failover keeps, at one round trip each.

    The rule: **a write is done only once** :attr:`replicas` **replicas have it.** A ``WAIT``
    that gives up after ``timeout_ms`` with fewer (:meth:`wait` returns False) leaves the write
    on this primary only, where a failover may drop it; whoever made it acts as if it may not
    have happened:

    - a lease taken: it is no lease; the job is not started, the lease is released and the
      message goes back to its queue (:meth:`tasks.worker.lease.LeaseKeeper.take`);
    - a lease renewed: it does not count towards self-fencing; the job is stopped
      ``fence_after_s`` after the last renewal a replica had, before the copy of the lease a
      promoted replica holds can expire and the job be given to another worker;
    - a result stored: it is not acknowledged anywhere else (the channel's acknowledgement
      stays kombu's bookkeeping: a new primary still holds the message and the job's lease,
      whose reaper gives the job back to run again); the lease keeper logs it as unconfirmed
      (:class:`tasks.core.backend.FleetBackend`);
    - a message published, a message given back, an Optuna journal entry: logged as
      unconfirmed, the caller goes on (the write may well be kept: a replica late by more than
      ``timeout_ms`` is no partition, and sending the message again would run its job twice).

    With ``replicas=0`` nothing is waited for and every write counts as done (no round trip).
    """

    replicas: int = 0
    timeout_ms: int = REDIS_WAIT_TIMEOUT_MS

    def to_dict(self) -> dict[str, int]:
        """As a Celery setting or a transport option carries it (plain JSON)."""
        return {"replicas": self.replicas, "timeout_ms": self.timeout_ms}

    @classmethod
    def of(cls, value: Any) -> Replication:
        """From :meth:`to_dict`'s form; ``None`` (an app made without it): wait for none."""
        return cls(**value) if isinstance(value, dict) else cls()

    def wait(self, client: Any, what: str) -> bool:
        """``WAIT`` for :attr:`replicas` after the writes ``client`` made; ``what`` names them in
        the warning when fewer replicas had them in time.

        Returns:
            Whether the writes are done by the rule above: True with ``replicas=0`` (no round
            trip) or when enough replicas had them within :attr:`timeout_ms`.
        """
        if self.replicas <= 0:
            return True
        acked = int(client.execute_command("WAIT", self.replicas, self.timeout_ms))
        if acked < self.replicas:
            logger.warning("%s: %d of %d replicas had it within %d ms: not done (a failover now could lose it)",
                           what, acked, self.replicas, self.timeout_ms)
            return False
        return True


def is_sentinel(url: str) -> bool:
    """Whether ``url`` is a Sentinel URL (either form)."""
    return url.strip().lower().startswith(f"{SCHEME}://")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost


def first_host(url: str) -> str | None:
    """The host of the first sentinel of a Sentinel URL (``None`` if it names none)."""
    try:
        return SentinelURL.parse(url).sentinels[0][0]
    except ValueError:
        return None


def redact(url: str) -> str:
    """``url`` with the Redis and sentinel passwords replaced by ``***``."""
    out = []
    for chunk in url.split(";"):
        scheme, sep, rest = chunk.partition("://")
        base, q, query = rest.partition("?")
        userinfo, at, hosts = base.rpartition("@")
        if at and ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        query = _PASSWORD_OPTION.sub(r"\1***", query)
        out.append(f"{scheme}{sep}{userinfo}{at}{hosts}{q}{query}")
    return ";".join(out)


def _host_port(address: str) -> tuple[str, int]:
    address = address.strip()
    if not address:
        raise ValueError("a sentinel's address is empty")
    if address.startswith("["):  # [::1]:26379
        host, _, rest = address[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = address.partition(":")
    if not host:
        raise ValueError(f"a sentinel has no host ({address!r})")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"sentinel {address!r} has no valid port")
    return host, int(port_text)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
