"""The result backend: Celery's Redis backend, with a failed job's entry kept beside its error.

A job that fails ends its Celery task in FAILURE (Flower's Failed column, ``AsyncResult.state``
and ``celery inspect`` say so) with the job's own exception type and message. The worker
attaches the device's error entry to that exception (:func:`attach_entry`); this backend stores
it in the serialized exception under :data:`tasks.core.keys.ENTRY_FIELD`, where Celery's own
readers ignore it.

A chord whose header task failed normally fails its body with a ``ChordError``. Here a failed
part is unpacked into its error entry instead, so the chord's collect step always runs and
collects ``{device: entry}`` for every device, failed ones included.

Storing a state is one script call (:data:`_STORE`), not Celery's GET of the stored state and
then a MULTI: a state is never stored over a finished one (SUCCESS, FAILURE, REVOKED). A device
worker finishing a job hands the backend a :class:`JobFinish` on the task's request; the same
script then also releases the job's lease and counts the job in the fleet's metrics, so the
lease goes only together with the stored result (a copy of the message redelivered at any moment
finds the lease held or the result stored) and a job's end costs one round trip. With the job's
message (:class:`StoredAck`), the script acknowledges it too: it takes it out of kombu's unacked
hash and index, as kombu's own acknowledgement would, right after the result is stored.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import ConnectionError as RedisConnectionError

from . import keys
from .errors import NoFleetError
from .keys import ENTRY_FIELD
from .records import Entry, ErrorInfo
from .transport import NO_FLEET_OPTION

logger = logging.getLogger(__name__)

#: Attribute of an exception that carries the failed job's entry (a JSON dict).
_ENTRY_ATTR = "devicefleet_entry"
#: Attribute of a task's request that carries its :class:`JobFinish`.
FINISH_ATTR = "devicefleet_finish"

#: Lua functions the state-storing scripts share (here and in :mod:`tasks.worker.lease`):
#: ``finished(key)``, whether the meta stored under ``key`` is a finished state (SUCCESS, FAILURE,
#: REVOKED); ``store(key, value, expires)``, Celery's write of a state: SETEX (SET when
#: ``expires`` is 0) and a PUBLISH for the producers waiting on it.
LUA_STATE_FUNCTIONS = """
local finished = function(key)
  local current = redis.call('get', key)
  if not current then return false end
  local ok, meta = pcall(cjson.decode, current)
  return ok and type(meta) == 'table' and (meta.status == 'SUCCESS' or meta.status == 'FAILURE'
    or meta.status == 'REVOKED')
end
local store = function(key, value, expires)
  if tonumber(expires) > 0 then
    redis.call('setex', key, expires, value)
  else
    redis.call('set', key, value)
  end
  redis.call('publish', key, value)
end
"""

#: Store a task's state unless a finished one is stored; with a job's finish, release its lease,
#: count it and acknowledge its message. KEYS: the task's meta key, its lease key,
#: ``keys.LEASES``, the device's stats hash, ``keys.STATS_DEVICES``, the device's finished set,
#: kombu's unacked hash and its index. ARGV: the encoded meta, expiry in seconds (0: none), the
#: lease value ('' if none), the task id, the count as JSON ('' if none), the message's delivery
#: tag ('' if none). Returns 1 if stored, 0 if a finished state was there already (nothing
#: stored or counted; the lease is released and the message acknowledged all the same).
_STORE = LUA_STATE_FUNCTIONS + """
local release = function()
  if ARGV[6] ~= '' then
    redis.call('zrem', KEYS[8], ARGV[6])
    redis.call('hdel', KEYS[7], ARGV[6])
  end
  if ARGV[3] == '' then return end
  if redis.call('get', KEYS[2]) == ARGV[3] then redis.call('del', KEYS[2]) end
  if redis.call('hget', KEYS[3], ARGV[4]) == ARGV[3] then redis.call('hdel', KEYS[3], ARGV[4]) end
end
if finished(KEYS[1]) then
  release()
  return 0
end
store(KEYS[1], ARGV[1], ARGV[2])
release()
if ARGV[5] ~= '' then
  local count = cjson.decode(ARGV[5])
  redis.call('sadd', KEYS[5], count.device)
  redis.call('hincrby', KEYS[4], count.outcome, 1)
  for field, value in pairs(count.add) do redis.call('hincrbyfloat', KEYS[4], field, value) end
  for field, value in pairs(count.set) do redis.call('hset', KEYS[4], field, value) end
  redis.call('zadd', KEYS[6], count.finished, ARGV[4])
  redis.call('zremrangebyscore', KEYS[6], '-inf', count.keep_after)
end
return 1
"""


@dataclass
class StoredAck:
    """A job's message, acknowledged by the script that stores the job's result: kombu's
    unacked hash and index (the channel's names) and the message's delivery tag. ``done`` is
    set once the script ran; the worker's request then skips kombu's own round trip."""

    unacked_key: str
    unacked_index_key: str
    delivery_tag: str
    done: bool = False


@dataclass
class JobFinish:
    """What a device worker asks the backend to do with a job's finished state, in the same
    script call that stores it (``setattr(task.request, FINISH_ATTR, finish)``).

    Attributes:
        lease: the job's lease value, released if it is still ours; ``None``: no lease.
        count: the job's counters for the fleet's metrics
            (:func:`tasks.worker.accounting.job_count`); ``None``: not counted.
        ack: the job's message, acknowledged in the same call; ``None``: Celery acknowledges it.
        on_stored: called once the script has run (the worker forgets the lease).
    """

    device: str
    lease: str | None = None
    count: dict[str, Any] | None = None
    ack: StoredAck | None = None
    on_stored: Callable[[], None] | None = None


def attach_entry(exc: BaseException, entry: Entry) -> BaseException:
    """Make ``exc`` carry ``entry`` into the stored failure; returns ``exc``."""
    setattr(exc, _ENTRY_ATTR, entry.to_dict())
    return exc


def entry_of_failure(stored: Any) -> dict[str, Any]:
    """The error entry of a stored failure: the one the worker attached, else one made from the
    exception's type and message (a failure that happened outside the job, e.g. a rejected
    message). Its ``device`` is empty then: the caller knows which device it asked."""
    if isinstance(stored, dict):
        entry = stored.get(ENTRY_FIELD)
        if isinstance(entry, dict):
            return entry
        args = stored.get("exc_message")
        message = " ".join(str(a) for a in args) if isinstance(args, (list, tuple)) else str(args)
        error = ErrorInfo(type=str(stored.get("exc_type") or "Exception"), message=message)
    elif isinstance(stored, BaseException):
        error = ErrorInfo.of(stored)
    else:
        error = ErrorInfo(type="FanOutError", message=f"no entry: the job left {stored!r}")
    return Entry.make(device="", worker=None, output=None, error=error, started=None,
                      finished=None).to_dict()


class FleetBackend(RedisBackend):
    """Celery's Redis result backend; see the module's docstring for what it adds."""

    def remove_pending_result(self, result: Any, _finalizing: Any = sys.is_finalizing) -> Any:
        """Stop listening for ``result`` (Celery calls this from ``AsyncResult.__del__``).

        A producer script that exits with a result still pending (it read ``states()`` or
        ``progress()`` and never ``get()``, or caught :class:`FanOutTimeout`) would otherwise
        open a Redis connection to unsubscribe while the interpreter shuts down, and print
        ``Exception ignored in ... AsyncResult.__del__ ... sys.meta_path is None``. Redis drops
        the subscription with the connection anyway, so at shutdown there is nothing to do.
        (``sys.is_finalizing`` is bound as a default: module globals may be gone by then.)
        Likewise when Redis is unreachable: a result collected after its fleet stopped.
        """
        if _finalizing():
            return result
        try:
            return super().remove_pending_result(result)
        except (RedisConnectionError, OSError, RuntimeError) as exc:
            # Redis is gone (stopped, restarting): its subscriptions went with the connection.
            # (Celery's result consumer turns a connection that stays down into RuntimeError.)
            logger.debug("result %s: could not unsubscribe (%s); nothing left to do", result.id, exc)
            return result

    def prepare_exception(self, exc: BaseException, serializer: str | None = None) -> Any:
        prepared = super().prepare_exception(exc, serializer)
        entry = getattr(exc, _ENTRY_ATTR, None)
        if isinstance(prepared, dict) and entry is not None:
            prepared[ENTRY_FIELD] = entry
        return prepared

    @cached_property
    def _store_script(self) -> Any:
        # Called by hash (EVALSHA): the script's text is sent once per connection pool.
        return self.client.register_script(_STORE)

    def _store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        """Store ``state`` in one script call (see the module's docstring).

        Celery keeps a stored SUCCESS against later writes; a failed job's FAILURE and a
        cancelled one's REVOKED are as final. Otherwise a redelivered copy of a failed job would
        store STARTED over it, the lease's "already finished" check would miss it, and the job
        would run twice.
        """
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        finish = getattr(request, FINISH_ATTR, None) if state in states.READY_STATES else None
        expires = (self.failure_expires if state == states.FAILURE else None) or self.expires or 0
        self.ensure(self._store, (bytes_to_str(task_id), value, int(expires), finish))
        if finish is not None:
            if finish.ack is not None:
                finish.ack.done = True
            if finish.on_stored is not None:
                finish.on_stored()
        return result

    def _store(self, task_id: str, value: Any, expires: int, finish: JobFinish | None) -> int:
        finish = finish or JobFinish(device="")
        ack = finish.ack or StoredAck(unacked_key="", unacked_index_key="", delivery_tag="")
        return int(self._store_script(
            keys=[self.get_key_for_task(task_id), keys.lease(task_id), keys.LEASES, keys.stats(finish.device),
                  keys.STATS_DEVICES, keys.finished(finish.device), ack.unacked_key, ack.unacked_index_key],
            args=[value, expires, finish.lease or "", task_id,
                  json.dumps(finish.count) if finish.count is not None else "", ack.delivery_tag],
        ))

    def metas(self, task_ids: list[str]) -> list[dict[str, Any] | None]:
        """Each task's stored meta (``status``, ``result``...), ``None`` where none is stored or
        it cannot be read: one ``MGET`` for all of them."""
        if not task_ids:
            return []
        raw = self.ensure(self.client.mget, ([self.get_key_for_task(task_id) for task_id in task_ids],))
        out: list[dict[str, Any] | None] = []
        for value in raw:
            try:
                meta = self.decode(value) if value is not None else None
            except Exception:  # noqa: BLE001  (a malformed value reads as not there)
                meta = None
            out.append(meta if isinstance(meta, dict) else None)
        return out

    def set_chord_size(self, group_id: Any, chord_size: int) -> None:
        """Celery's two writes (the counter's reset, the size) in one round trip."""
        def write() -> None:
            pipe = self.client.pipeline()
            pipe.delete(self.get_key_for_group(group_id, ".c"))
            pipe.set(self.get_key_for_group(group_id, ".s"), chord_size, ex=self.chord_expires or None)
            pipe.execute()

        self.ensure(write, ())

    def _unpack_chord_result(self, tup: Any, decode: Any,
                             EXCEPTION_STATES: frozenset[str] = states.EXCEPTION_STATES,
                             PROPAGATE_STATES: frozenset[str] = states.PROPAGATE_STATES) -> Any:
        _, _tid, state, retval = decode(tup)
        if state in EXCEPTION_STATES:
            return entry_of_failure(retval)
        return retval


class NoFleetBackend(FleetBackend):
    """The result backend of an app that found no fleet (see
    :class:`tasks.core.transport.NoFleetTransport`): using it raises the :class:`NoFleetError`."""

    def __init__(self, app: Any = None, **kwargs: Any) -> None:
        raise NoFleetError(str(app.conf.get(NO_FLEET_OPTION) if app is not None else "no fleet to connect to"))
