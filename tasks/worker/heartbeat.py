"""A device worker's heartbeat: its registry record, kept alive in Redis from a thread.

The record (:class:`~tasks.core.records.WorkerRecord`) lives at ``keys.worker(device)`` with a
TTL of ``heartbeat_ttl_s`` and is written every ``heartbeat_interval_s``; :meth:`Heartbeat.update`
changes fields (the job running now, its progress) and wakes the thread, which writes them at
once or after a short delay that folds close updates into one write (:data:`~tasks.core.defaults.HEARTBEAT_COALESCE_S`), so
producers see the change without the job's own thread waiting on Redis.

Beside it, the JSON schemas of the worker's jobs' params (``keys.job_schemas(device)``, a hash
producers check kwargs with: :mod:`tasks.core.arguments`) are written with the first write and
then only kept alive with the record's TTL: large, and never changed while the worker lives.

Its life is the registry step's (:mod:`tasks.worker.steps`): built with the worker, started once
the worker joins (the first write), stopped when it leaves (the record removed). An update after
that changes the record in memory only: a job that ends while the worker leaves does not bring the
device back into the registry for a TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from ..core import keys
from ..core.periodic import PeriodicThread
from ..core.records import WorkerRecord

logger = logging.getLogger(__name__)


class Heartbeat(PeriodicThread):
    """Keeps one worker's registry record alive."""

    name = "devicefleet-heartbeat"

    def __init__(self, client: redis.Redis, record: WorkerRecord, interval_s: float, ttl_s: float,
                 schemas: Mapping[str, str] | None = None) -> None:
        super().__init__(interval_s)
        self.client = client
        self._record = record
        #: ``{job: JSON schema}`` published at ``keys.job_schemas(device)``: written with the
        #: first write (and again if Redis lost it), then only its TTL renewed with the record's.
        self._schemas: dict[FieldT, EncodableT] = {job: schema for job, schema in (schemas or {}).items()}
        self._schemas_written = False
        self._ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        #: Set by :meth:`stop`: the record is gone from Redis and is never written again.
        self._left = False
        #: Whether this heartbeat wrote the record: only then is it this worker's to remove (a
        #: worker refused because its device is taken must not remove its owner's).
        self._written = False

    @property
    def record(self) -> WorkerRecord:
        return self._record

    def start(self) -> None:
        """Write the record now (the device joins the fleet), then keep it alive."""
        self.write()
        super().start()

    def update(self, *, after_s: float = 0.0, **fields: Any) -> None:
        """Change fields of the record; the heartbeat thread writes them at once, or within
        ``after_s`` seconds: updates that come closer together than that (a short job's "busy"
        and "idle", a run of short jobs) go out in one write, the latest fields."""
        with self._lock:
            self._record = self._record.model_copy(update=fields)
        if self.alive:
            self.wake(after_s)
        else:
            self.write()

    def update_slot(self, index: int, *, after_s: float = 0.0, **fields: Any) -> None:
        """Change fields of slot ``index``'s record (and of the worker's with ``worker_fields``),
        written as :meth:`update` writes."""
        worker_fields = fields.pop("worker_fields", None) or {}
        with self._lock:
            slots = list(self._record.slots)
            if 0 <= index < len(slots):
                slots[index] = slots[index].model_copy(update=fields)
            self._record = self._record.model_copy(update={**worker_fields, "slots": slots})
        if self.alive:
            self.wake(after_s)
        else:
            self.write()

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating and remove the record: the device leaves the fleet now."""
        with self._write_lock, self._lock:
            self._left = True
        super().stop(timeout)
        if not self._written:
            return
        device = self._record.device
        try:
            pipe = self.client.pipeline()
            pipe.delete(keys.worker(device), keys.job_schemas(device))
            pipe.srem(keys.WORKERS, device)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("could not remove %s from the registry: %s", device, exc)

    def write(self) -> None:
        """Write the record and its index entry (one round trip); nothing once it left."""
        # Writes are serialised (_write_lock) so that a record serialised earlier never lands
        # after one serialised later, nor any after stop(); the record's own lock is held only to
        # serialise it, not through the round trip: an update() (a job's memory sample, its end)
        # never waits on a Redis that does not answer (a cut-off worker's job must be stopped
        # meanwhile), and the wake it makes writes it next.
        with self._write_lock:
            with self._lock:
                if self._left:
                    return
                self._record = self._record.model_copy(update={"heartbeat_at": time.time()})
                device, value = self._record.device, self._record.to_json()
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.worker(device), value, px=self._ttl_ms)
            pipe.sadd(keys.WORKERS, device)
            if self._schemas:
                schemas = keys.job_schemas(device)
                if not self._schemas_written:  # a predecessor's schemas (other modules) go first
                    pipe.delete(schemas)
                    pipe.hset(schemas, mapping=self._schemas)
                pipe.pexpire(schemas, self._ttl_ms)
            replies = pipe.execute()
            self._written = True
            # The schemas are large and never change: only their TTL goes with each beat; a
            # failed-over Redis that lost them (pexpire answers 0) gets them at the next.
            self._schemas_written = bool(self._schemas) and bool(replies[-1])

    def tick(self) -> None:
        self.write()
