"""The live fleet registry, read side: each device worker's record in Redis, under a TTL.

A worker writes ``keys.worker(device)`` (a :class:`~tasks.core.records.WorkerRecord`) from its
heartbeat (:class:`tasks.worker.heartbeat.Heartbeat`) and deletes it on a clean shutdown; a dead
worker's record simply expires. Producers read the registry directly, never waiting on a
broadcast.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis
from kombu.utils.encoding import bytes_to_str
from pydantic import ValidationError

from . import keys
from .defaults import REDIS_CONNECT_TIMEOUT_S, REDIS_HEALTH_CHECK_INTERVAL_S
from .errors import FleetError
from .records import WorkerRecord, stored
from .sentinel import SentinelURL, is_sentinel
from .settings import redact_url
from .users import denial

if TYPE_CHECKING:
    import redis.asyncio

logger = logging.getLogger(__name__)


def connect(url: str, *, decode_responses: bool = True) -> redis.Redis:
    """A redis-py client for ``url`` that decodes replies to ``str`` (unless told not to).

    For a ``sentinel://`` URL, a client of the current primary that follows a failover
    (:meth:`tasks.core.sentinel.SentinelURL.client`).
    """
    options = {"socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S, "health_check_interval": REDIS_HEALTH_CHECK_INTERVAL_S}
    if is_sentinel(url):
        return SentinelURL.parse(url).client(decode_responses=decode_responses, **options)
    return redis.Redis.from_url(url, decode_responses=decode_responses, **options)


def connect_async(url: str, **options: Any) -> redis.asyncio.Redis:
    """A ``redis.asyncio`` client for ``url`` (``bytes`` replies), bound to the running event
    loop once used; for a ``sentinel://`` URL, one that follows a failover
    (:meth:`tasks.core.sentinel.SentinelURL.async_client`). ``options`` go to the connections."""
    options = {"socket_connect_timeout": 5, **options}
    if is_sentinel(url):
        return SentinelURL.parse(url).async_client(**options)
    import redis.asyncio  # noqa: F811  (at run time only when used: it loads asyncio)

    return redis.asyncio.Redis.from_url(url, **options)


@contextmanager
def reading(url: str) -> Iterator[redis.Redis]:
    """A client of ``url`` for a few reads (``devicefleet status``), closed at the end.

    Raises:
        FleetError: a read failed (Redis down, wrong password); the message has the URL without
            its password and redis-py's reason.
    """
    check_sentinels(url)
    client = connect(url)
    try:
        yield client
    except Exception as exc:  # redis-py's errors, said plainly
        refused = denial(exc, urlsplit(url).username or None)  # a user's wrong or revoked credentials
        if refused is not None:
            raise refused from None
        raise FleetError(f"cannot read the fleet at {redact_url(url)}: {exc}") from exc
    finally:
        client.close()


def check_sentinels(url: str) -> None:
    """For a ``sentinel://`` URL, fail at once when no sentinel names the primary (each is asked
    once: :meth:`tasks.core.sentinel.SentinelURL.problem`); any other URL passes.

    Raises:
        FleetError: every sentinel is unreachable, refuses the password, or monitors no such
            master; the message names each, with the URL's passwords redacted.
    """
    if not is_sentinel(url):
        return
    problem = SentinelURL.parse(url).problem()
    if problem is not None:
        raise FleetError(f"cannot reach the fleet at {redact_url(url)}: {problem}")


def _parse(device: str, raw: str | bytes | None) -> WorkerRecord | None:
    """``raw`` as a record (one a newer worker wrote is read without the fields this version does
    not know: :func:`~tasks.core.records.stored`); None, with a warning, when it is malformed."""
    if raw is None:
        return None
    try:
        return stored(WorkerRecord, raw)
    except ValidationError:
        logger.warning("registry record of %s is malformed; ignoring it", device)
        return None


def read_worker(client: redis.Redis, device: str) -> WorkerRecord | None:
    """The record of ``device``'s worker, or None if it has none (or it expired)."""
    return _parse(device, client.get(keys.worker(device)))  # type: ignore[arg-type]


#: The registry in one round trip. KEYS[1]: ``keys.WORKERS``; ARGV[1]: the record keys' prefix
#: (``keys.worker("")``). Returns ``[device, record or '', ...]``.
_READ_REGISTRY = """
local out = {}
for _, device in ipairs(redis.call('smembers', KEYS[1])) do
  out[#out + 1] = device
  out[#out + 1] = redis.call('get', ARGV[1] .. device) or ''
end
return out
"""


def live_workers(client: redis.Redis) -> dict[str, WorkerRecord]:
    """``{device: record}`` of every worker whose heartbeat has not expired, by device name
    (one round trip: the index and the records in one script call)."""
    reply = client.register_script(_READ_REGISTRY)(keys=[keys.WORKERS], args=[keys.worker("")])
    pairs = sorted(zip(reply[::2], reply[1::2], strict=True))  # type: ignore[index]
    live: dict[str, WorkerRecord] = {}
    for name, raw in pairs:
        device = bytes_to_str(name)
        record = _parse(device, raw or None)
        if record is not None:
            live[device] = record
    return live


def job_schemas(client: redis.Redis, runs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """``{(device, job): JSON schema of the job's params}`` as each device's worker published it
    (:func:`tasks.core.keys.job_schemas`), one round trip; a pair without one (a worker from
    before schemas were published, a job with no JSON schema) is left out."""
    pairs = list(dict.fromkeys(runs))
    pipe = client.pipeline(transaction=False)
    for device, job in pairs:
        pipe.hget(keys.job_schemas(device), job)
    return {pair: bytes_to_str(raw) for pair, raw in zip(pairs, pipe.execute(), strict=True) if raw}
