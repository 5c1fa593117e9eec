"""The result backend: Celery's Redis backend, with a failed job's entry kept beside its error.

A job that fails ends its Celery task in FAILURE (Flower's Failed column, ``AsyncResult.state``
and ``celery inspect`` say so) with the job's own exception type and message. The worker
attaches the device's error entry to that exception (:func:`attach_entry`); this backend stores
it in the serialized exception under :data:`tasks.core.keys.ENTRY_FIELD`, where Celery's own
readers ignore it.

Two rules of the fleet's own differ from Celery's, and hold for the fleet's jobs and chords
only; every other task keeps Celery's semantics (its integration tests check it:
``tests/celery_suite``):

- A chord whose header task failed normally fails its body with a ``ChordError`` (its errbacks
  run, its body does not). In a fan-out's chord (its body is ``devicefleet.collect``) a failed
  or cancelled part is unpacked into its error entry instead, so the collect step always runs
  and collects ``{device: entry}`` for every device, failed ones included.
- Celery never stores a state over a SUCCESS. For a devicefleet job (a ``devicefleet.*`` task,
  or a store without a task name: the fleet's own cancels) FAILURE and REVOKED are as final, so
  a redelivered copy of a failed or cancelled job never stores STARTED over it and runs again.

Storing a state is one script call (:meth:`tasks.core.jobstate.JobState.finish`), not Celery's
GET of the stored state and then a MULTI, and never over a final one (above). A device worker
finishing a job hands the backend the job's :class:`~tasks.core.jobstate.JobEnd` with the task's
request (:func:`tasks.core.jobstate.hand_over`: the one seam, see that module); the same script
then also releases the job's lease, counts the job in the fleet's metrics and acknowledges its
message (takes it out of kombu's unacked hash and index, as kombu's own acknowledgement would),
so the lease goes only together with the stored result (a copy of the message redelivered at any
moment finds the lease held or the result stored) and a job's end costs one round trip. What the
store did is recorded on the hand-over, for the worker's lease keeper.

On a fleet with replicas the store then waits for a replica to have it (Redis's ``WAIT``,
:class:`tasks.core.sentinel.Replication`): the result, the lease's release and the
acknowledgement survive a failover that comes after. A store no replica had in time is not done
(:class:`~tasks.core.sentinel.Replication`'s rule): recorded on the hand-over
(``confirmed=False``, which the lease keeper logs) and its message left unacknowledged
everywhere but on the primary that took it, so a failover that drops it runs the job again. A ``sentinel://`` fleet's backend is
:class:`FleetSentinelBackend`: the same over Celery's Sentinel backend.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend, ResultConsumer, SentinelBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import ConnectionError as RedisConnectionError

from .errors import NoFleetError
from .job import COLLECT_TASK, PROGRESS_STATE, TASK_PREFIX
from .jobstate import Attempt, JobEnd, JobState, StateMeta, Stored, handover
from .keys import ENTRY_FIELD
from .records import Entry, ErrorInfo
from .sentinel import ReadOnlyAwareConnection, Replication, disconnect_pool
from .transport import NO_FLEET_OPTION, REPLICATION_OPTION, acked_in_redis

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


def fleet_task(request: Any) -> bool:
    """Whether a state stored with ``request`` is a devicefleet job's (a ``devicefleet.*`` task,
    or no task named: the fleet's own stores, such as a sweep's cancel), whose finished states
    are all final."""
    name = getattr(request, "task", None)
    return not isinstance(name, str) or not name or name.startswith(TASK_PREFIX)


def fan_out_chord(request: Any) -> bool:
    """Whether ``request`` is a part of a fan-out's chord (its body is ``devicefleet.collect``)."""
    body = getattr(request, "chord", None)
    name = body.get("task") if isinstance(body, dict) else getattr(body, "task", None)
    return name == COLLECT_TASK


class FleetResultConsumer(ResultConsumer):
    """Celery's Redis result consumer, which never reconnects to stop listening.

    Celery's consumer reconnects on any connection error, retrying for as long as the backend's
    retry policy allows (two minutes on the fleet's), and then logs that the application must be
    restarted. That is right for a wait, and wrong for an unsubscribe: a result handle collected
    after its fleet's Redis stopped (``AsyncResult.__del__``, wherever the collector happens to
    run) blocked that long. A subscription goes with its connection, so while
    :meth:`stopping` an error just ends the unsubscribe; the next wait finds the connection down
    and reconnects (subscribing to what is still awaited) as before.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stopping = threading.local()

    @contextmanager
    def stopping(self) -> Iterator[None]:
        """Within the block, this thread's connection errors end what it does: no reconnect."""
        outer, self._stopping.active = getattr(self._stopping, "active", False), True
        try:
            yield
        finally:
            self._stopping.active = outer

    # Celery internal: what reconnect_on_error calls on a connection error (5.7.0).
    def _reconnect(self) -> None:
        if getattr(self._stopping, "active", False):
            logger.debug("result consumer: the connection is down while unsubscribing; the next wait reconnects")
            return
        super()._reconnect()


class FleetBackend(RedisBackend):
    """Celery's Redis result backend; see the module's docstring for what it adds.

    It overrides and reads Celery internals, named where each is used, checked on Celery 5.7.0
    (pyproject.toml's floor, and the newest release when they were checked; `.ci/floors` runs
    the tests on the floor, the full suite on the newest).
    """

    #: Set by :meth:`tasks.core.app.FleetCelery.close`: the app's connections are closed, and a
    #: result collected later has no subscription left to end (it would otherwise open a
    #: connection to unsubscribe).
    closed = False

    # Celery internal: the class the backend makes its result consumer from (5.7.0).
    ResultConsumer = FleetResultConsumer

    # Celery internal: RedisBackend._create_client makes the client behind ``client`` (5.7.0).
    def _create_client(self, **params: Any) -> Any:
        """Celery's, with the client's connections (and, on Sentinel, its sentinels') closed when
        this backend is garbage-collected (its app dropped without ``close()``): a finalizer that
        holds only the pool closes them, where the collector would otherwise find each socket
        open (a ``ResourceWarning``)."""
        client = super()._create_client(**params)
        weakref.finalize(self, disconnect_pool, client.connection_pool)
        return client

    # Celery internal: the result consumer's hook, called from AsyncResult.__del__ (5.7.0).
    def remove_pending_result(self, result: Any, _finalizing: Any = sys.is_finalizing) -> Any:
        """Stop listening for ``result`` (Celery calls this from ``AsyncResult.__del__``).

        A producer script that exits with a result still pending (it read ``states()`` or
        ``progress()`` and never ``get()``, or caught :class:`FanOutTimeout`) would otherwise
        open a Redis connection to unsubscribe while the interpreter shuts down, and print
        ``Exception ignored in ... AsyncResult.__del__ ... sys.meta_path is None``. Redis drops
        the subscription with the connection anyway, so at shutdown there is nothing to do.
        (``sys.is_finalizing`` is bound as a default: module globals may be gone by then.)
        Likewise when Redis is unreachable: a result collected after its fleet stopped ends its
        subscription at the first connection error, never retrying (:class:`FleetResultConsumer`).
        """
        if _finalizing() or self.closed:
            return result
        try:
            with self.result_consumer.stopping():
                return super().remove_pending_result(result)
        except (RedisConnectionError, OSError, RuntimeError) as exc:
            # Redis is gone (stopped, restarting): its subscriptions went with the connection.
            # (Celery's result consumer turns a connection that stays down into RuntimeError.)
            logger.debug("result %s: could not unsubscribe (%s); nothing left to do", result.id, exc)
            return result

    # Celery internal: how a failure is serialized before it is stored (5.7.0).
    def prepare_exception(self, exc: BaseException, serializer: str | None = None) -> Any:
        prepared = super().prepare_exception(exc, serializer)
        entry = getattr(exc, _ENTRY_ATTR, None)
        if isinstance(prepared, dict) and entry is not None:
            prepared[ENTRY_FIELD] = entry
        return prepared

    @cached_property
    def _jobs(self) -> JobState:
        # Its scripts are called by hash (EVALSHA): each text is sent once per connection pool.
        return JobState(self.client)

    # Celery internals: BaseKeyValueStoreBackend._store_result, the one writer of a task's
    # state, and what it uses: _get_result_meta, _MAX_STR_VALUE_SIZE, and failure_expires
    # (new in Celery 5.7.0: result_failure_expires; 5.6.3 and older lack it). Checked on 5.7.0.
    def _store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        """Store ``state`` in one script call (see the module's docstring).

        Celery keeps a stored SUCCESS against later writes; a failed job's FAILURE and a
        cancelled one's REVOKED are as final (:func:`fleet_task`). Otherwise a redelivered copy
        of a failed job would store STARTED over it, the lease's "already finished" check would
        miss it, and the job would run twice. Any other task keeps Celery's rule.
        """
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        handed = handover(request) if state in states.READY_STATES else None
        expires = (self.failure_expires if state == states.FAILURE else None) or self.expires or 0
        state_meta = StateMeta(key=bytes_to_str(self.get_key_for_task(task_id)), value=value, expires_s=int(expires))
        stored, confirmed = self.ensure(self._store, (bytes_to_str(task_id), state_meta,
                                                      handed.end if handed else None, fleet_task(request)))
        if handed is not None:
            handed.stored, handed.confirmed = stored, confirmed
            if not confirmed:
                self._leave_unacked(request, handed.end)
        return result

    @staticmethod
    def _leave_unacked(request: Any, end: JobEnd) -> None:
        """No replica had the store of a job's end: it is not done (Replication's rule). Its
        message must stay unacknowledged on any other primary: the channel's acknowledgement that
        follows is made kombu's bookkeeping only, as after the script's own. (The script's
        acknowledgement, on this primary, goes with the result if a failover drops it; the new
        primary's reaper then gives the job back from its lease.)"""
        tag = end.ack.delivery_tag if end.ack is not None else (getattr(request, "properties", None) or {}).get(
            "delivery_tag")
        if tag:
            acked_in_redis(str(tag))

    @cached_property
    def replication(self) -> Replication:
        """The replicas a stored state waits for (the app's :data:`REPLICATION_OPTION`)."""
        return Replication.of(self.app.conf.get(REPLICATION_OPTION))

    def store_progress(self, attempt: Attempt, report: dict[str, Any], request: Any, expires_s: int,
                       device: str) -> bool:
        """Store a running job's progress ``report`` for ``attempt`` as its PROGRESS state and
        under its progress key (kept ``expires_s``), in one script call that refuses an older
        attempt's (:meth:`tasks.core.jobstate.JobState.progress`): False if refused."""
        task_id = attempt.task_id
        meta = self._get_result_meta(result=self.encode_result(report, PROGRESS_STATE), state=PROGRESS_STATE,
                                     traceback=None, request=request)
        meta["task_id"] = task_id
        state_meta = StateMeta(key=bytes_to_str(self.get_key_for_task(task_id)), value=self.encode(meta),
                               expires_s=int(self.expires or 0))
        return bool(self.ensure(self._jobs.progress, (attempt, state_meta, json.dumps(report), expires_s, device)))

    def _store(self, task_id: str, meta: StateMeta, end: JobEnd | None, final: bool) -> tuple[Stored, bool]:
        """The store (:meth:`JobState.finish`) and whether a replica had it in time."""
        stored = self._jobs.finish(task_id, meta, end, final=final)
        # A failover while waiting is a connection error: ensure() runs the script again on the
        # new primary, where it stores what was lost or finds it stored (it is idempotent).
        return stored, self.replication.wait(self.client, f"state of task {task_id}")

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

    # Celery internals: the chord counter's keys (get_key_for_group with ".c" and ".s") and
    # chord_expires (new in Celery 5.7.0: result_chord_expires). Checked on 5.7.0.
    def set_chord_size(self, group_id: Any, chord_size: int) -> None:
        """Celery's two writes (the counter's reset, the size) in one round trip."""
        def write() -> None:
            pipe = self.client.pipeline()
            pipe.delete(self.get_key_for_group(group_id, ".c"))
            pipe.set(self.get_key_for_group(group_id, ".s"), chord_size, ex=self.chord_expires or None)
            pipe.execute()

        self.ensure(write, ())

    # Celery internal: on_chord_part_return joins the header's parts when the last one returns
    # and reads each stored (type, id, state, result) tuple with _unpack_chord_result, whose
    # signature is Celery's (5.7.0).
    def on_chord_part_return(self, request: Any, state: str, result: Any, propagate: Any = None,
                             **kwargs: Any) -> Any:
        """Celery's, with a fan-out's failed parts read as their error entries (see the module's
        docstring); any other chord's as Celery reads them."""
        self._joining.fan_out = fan_out_chord(request)
        try:
            return super().on_chord_part_return(request, state, result, propagate=propagate, **kwargs)
        finally:
            self._joining.fan_out = False

    def _unpack_chord_result(self, tup: Any, decode: Any,
                             EXCEPTION_STATES: frozenset[str] = states.EXCEPTION_STATES,
                             PROPAGATE_STATES: frozenset[str] = states.PROPAGATE_STATES) -> Any:
        if not getattr(self._joining, "fan_out", False):
            return super()._unpack_chord_result(tup, decode, EXCEPTION_STATES, PROPAGATE_STATES)
        _, _tid, state, retval = decode(tup)
        if state in EXCEPTION_STATES:
            return entry_of_failure(retval)
        return retval

    @cached_property
    def _joining(self) -> threading.local:
        # Which chord this thread is joining (a backend is per thread; a local all the same).
        return threading.local()


class FleetSentinelBackend(FleetBackend, SentinelBackend):
    """:class:`FleetBackend` over Celery's Sentinel backend (``sentinel://``, with
    ``master_name`` and ``sentinel_kwargs`` in ``result_backend_transport_options``): its
    connections ask the sentinels for the primary, and take ``READONLY`` from a demoted one as a
    lost connection (:class:`tasks.core.sentinel.ReadOnlyAwareConnection`), which ``ensure()``
    and the result consumer retry."""

    # Celery internal: SentinelBackend._get_pool(**connparams), whose connparams reach
    # redis-py's Sentinel.master_for (Celery 5.7.0).
    def _get_pool(self, **params: Any) -> Any:
        return super()._get_pool(**{"connection_class": ReadOnlyAwareConnection, **params})


class NoFleetBackend(FleetBackend):
    """The result backend of an app that found no fleet (see
    :class:`tasks.core.transport.NoFleetTransport`): using it raises the :class:`NoFleetError`."""

    def __init__(self, app: Any = None, **kwargs: Any) -> None:
        raise NoFleetError(str(app.conf.get(NO_FLEET_OPTION) if app is not None else "no fleet to connect to"))
