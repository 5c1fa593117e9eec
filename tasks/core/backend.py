"""The result backend: Celery's Redis backend, with a failed job's entry kept beside its error.

A job that fails ends its Celery task in FAILURE (Flower's Failed column, ``AsyncResult.state``
and ``celery inspect`` say so) with the job's own exception type and message. The worker
attaches the device's error entry to that exception (:func:`attach_entry`); this backend stores
it in the serialized exception under :data:`tasks.core.keys.ENTRY_FIELD`, where Celery's own
readers ignore it.

A chord whose header task failed normally fails its body with a ``ChordError``. Here a failed
part is unpacked into its error entry instead, so the chord's collect step always runs and
collects ``{device: entry}`` for every device, failed ones included.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend
from redis.exceptions import ConnectionError as RedisConnectionError

from .errors import NoFleetError
from .keys import ENTRY_FIELD
from .records import Entry, ErrorInfo
from .transport import NO_FLEET_OPTION

logger = logging.getLogger(__name__)

#: Attribute of an exception that carries the failed job's entry (a JSON dict).
_ENTRY_ATTR = "devicefleet_entry"


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

    def _store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        # Celery keeps a stored SUCCESS against later writes; a failed job's FAILURE is as final.
        # Otherwise a redelivered copy of a failed job would store STARTED over it before
        # running, the lease's "already finished" check would miss it, and the job run twice.
        if self._get_task_meta_for(task_id)["status"] in states.READY_STATES:
            return result
        return super()._store_result(task_id, result, state, traceback, request, **kwargs)

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
