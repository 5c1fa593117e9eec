"""Leases: a running job is owned by one live worker, and a dead worker's job runs again fast.

Celery's Redis transport returns an unacknowledged message only after ``visibility_timeout``
(an hour), and a shorter timeout runs long jobs twice (celery#4984, #3501). devicefleet keeps the
long timeout and adds a lease per running job:

- when a worker starts a job it takes the lease ``devicefleet:lease:<task id>`` with ``SET NX``
  and a TTL (``lease_ttl_s``), and records ``{task id: owner, delivery tag}`` in the hash
  ``devicefleet:leases``. The key doubles as a mutex: a second copy of the same message (a
  visibility-timeout restore while the first still runs) finds it held by a live owner and is
  dropped (:class:`celery.exceptions.Ignore`), so a job never runs twice at the same time;
- a :class:`LeaseKeeper` thread renews the leases of the jobs this process runs;
- a :class:`Reaper` thread (in every worker; a Redis lock lets one reap at a time) looks at each
  recorded lease whose key has expired and whose owner is not alive in the fleet registry, and
  gives the message back to the front of its queue with the transport's own
  ``QoS.restore_by_tag``, which also removes it from kombu's ``unacked`` hash so the transport
  does not restore it a second time an hour later.

Recovery from a killed worker therefore takes about ``max(lease_ttl_s, heartbeat_ttl_s) +
reaper_interval_s``, whatever the job's length.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore
from celery.states import READY_STATES

from . import registry
from .devices import host_name

logger = logging.getLogger(__name__)

LEASE_PREFIX = "devicefleet:lease:"
LEASES_KEY = "devicefleet:leases"
REAPER_LOCK = "devicefleet:reaper:lock"
#: Counts of what the reaper did, for status and the tests: ``{"restored": n}``.
REAPER_STATS = "devicefleet:reaper:stats"


#: KEYS[1] lease key; ARGV: value read, new value, TTL ms. Set only if unchanged since read.
_COMPARE_AND_SET = """
local v = redis.call('get', KEYS[1])
if (v == false and ARGV[1] == '') or v == ARGV[1] then
  return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1
end
return 0
"""
#: KEYS: lease key, leases hash; ARGV: our value, TTL ms, task id. Renew (or restore after a Redis
#: restart lost it) our lease; leave a lease another worker took alone.
_RENEW = """
local v = redis.call('get', KEYS[1])
if v ~= false and v ~= ARGV[1] then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('hset', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
#: KEYS: lease key, leases hash; ARGV: our value, task id. Delete only what is ours.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end
if redis.call('hget', KEYS[2], ARGV[2]) == ARGV[1] then redis.call('hdel', KEYS[2], ARGV[2]) end
return 1
"""
_COMPARE_AND_DELETE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def lease_key(task_id: str) -> str:
    return f"{LEASE_PREFIX}{task_id}"


def owner_alive(client: redis.Redis, owner: dict[str, Any]) -> bool:
    """Whether ``owner`` (``{"device", "pid", "host"}``) is still the live worker of its device."""
    raw = client.get(registry.worker_key(str(owner.get("device"))))
    if raw is None:
        return False
    try:
        record = json.loads(raw)
    except ValueError:
        return False
    return bool(record.get("pid") == owner.get("pid") and record.get("host") == owner.get("host"))


class LeaseKeeper:
    """Takes, renews and releases the leases of the jobs this worker process runs."""

    def __init__(self, client: redis.Redis, device: str, worker: str, ttl_s: float) -> None:
        self._client = client
        self.owner = {"device": device, "worker": worker, "pid": os.getpid(), "host": host_name()}
        self._ttl_ms = int(ttl_s * 1000)
        self._interval = ttl_s / 3
        self._held: dict[str, str] = {}  # task id -> lease value
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devicefleet-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def acquire(self, task_id: str, delivery_tag: str | None, resend: dict[str, Any] | None = None) -> bool:
        """Take the lease of ``task_id``; False if another live worker holds it.

        A lease left by a dead owner (its key not yet expired) is taken over. ``resend`` is what
        the reaper needs to send the job again when its message is no longer in Redis.
        """
        record = {**self.owner, "task_id": task_id, "delivery_tag": delivery_tag,
                  "since": time.time(), "resend": resend}
        value = json.dumps(record)
        key = lease_key(task_id)
        if not self._client.set(key, value, nx=True, px=self._ttl_ms):
            raw = self._client.get(key)
            holder = json.loads(raw) if raw else {}
            if holder and holder.get("pid") == os.getpid() and holder.get("host") == host_name():
                with self._lock:
                    running_here = task_id in self._held
                if running_here:  # a copy reached another thread of this process: not twice at once
                    logger.warning("job %s already runs in this worker; not running this copy", task_id)
                    return False
                # else a lease this process left behind (its release failed): take it again
            elif holder and owner_alive(self._client, holder):
                logger.warning("job %s already runs on %s (pid %s); not running this copy",
                               task_id, holder.get("worker"), holder.get("pid"))
                return False
            else:
                logger.warning("taking over the lease of job %s from dead %s", task_id,
                               holder.get("worker"))
            # Only if it still holds what we read: two workers cannot both take it over.
            if not self._client.eval(_COMPARE_AND_SET, 1, key, raw or "", value, self._ttl_ms):
                logger.warning("job %s was taken by another worker meanwhile; not running this copy", task_id)
                return False
        self._client.hset(LEASES_KEY, task_id, value)
        with self._lock:
            self._held[task_id] = value
        return True

    def release(self, task_id: str) -> None:
        with self._lock:
            value = self._held.pop(task_id, None)
        try:
            # Only our own lease: a worker that was cut off must not delete its successor's.
            self._client.eval(_RELEASE, 2, lease_key(task_id), LEASES_KEY, value or "", task_id)
        except redis.RedisError as exc:  # the reaper finds an owner that is alive: no harm
            logger.warning("could not release the lease of job %s: %s", task_id, exc)

    @contextmanager
    def hold(self, task: Any) -> Iterator[None]:
        """Hold ``task``'s lease while the block runs.

        Raises:
            celery.exceptions.Ignore: another live worker runs this job now, or it has already
                finished (its result is stored); this copy is acknowledged and dropped, with
                no result stored.
        """
        request = task.request
        task_id = str(request.id)
        properties = getattr(request, "properties", None) or {}
        delivery_info = getattr(request, "delivery_info", None) or {}
        resend = {
            "name": task.name, "kwargs": request.kwargs, "queue": delivery_info.get("routing_key"),
            "chord": request.chord, "group_id": request.group, "group_index": request.group_index,
            "root_id": request.root_id, "parent_id": request.parent_id,
        }
        if not self.acquire(task_id, properties.get("delivery_tag"), resend):
            raise Ignore()
        if task.AsyncResult(task_id).state in READY_STATES:
            # A copy of a job that already finished (redelivered after its ack was lost).
            logger.warning("job %s has already finished; not running this copy", task_id)
            self.release(task_id)
            raise Ignore()
        try:
            yield
        finally:
            self.release(task_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                held = dict(self._held)
            for task_id, value in held.items():
                try:
                    if not self._client.eval(_RENEW, 2, lease_key(task_id), LEASES_KEY, value,
                                             self._ttl_ms, task_id):
                        logger.error("the lease of job %s was taken over by another worker", task_id)
                except redis.RedisError as exc:  # Redis restarting: renew on the next beat
                    logger.warning("could not renew the lease of job %s: %s", task_id, exc)


def reap_once(client: redis.Redis, app: Celery) -> list[str]:
    """Give back to their queues the jobs whose lease expired with their owner dead.

    Returns the task ids given back.
    """
    restored: list[str] = []
    leases = client.hgetall(LEASES_KEY)
    if not leases:
        return restored
    with app.connection_for_write() as conn:
        qos = conn.default_channel.qos
        for task_id, raw in leases.items():  # str: the registry's client decodes responses
            if client.exists(lease_key(str(task_id))):
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                client.hdel(LEASES_KEY, task_id)
                continue
            if owner_alive(client, record):
                continue  # alive but late to renew (Redis was away): it renews on its next beat
            tag = record.get("delivery_tag")
            if tag and client.hexists(qos.unacked_key, tag):
                # Back to the front of its queue, and out of kombu's unacked hash and index.
                qos.restore_by_tag(tag, leftmost=False)
            elif record.get("resend"):
                # The message is gone from Redis (a dropped duplicate copy acknowledged its
                # delivery tag): send the job again, same id, chord and group, from the lease.
                resend_job(app, str(task_id), record["resend"])
            else:
                logger.error("job %s of dead worker %s cannot be given back: its message is gone",
                             task_id, record.get("worker"))
            client.hdel(LEASES_KEY, task_id)
            client.hincrby(REAPER_STATS, "restored", 1)
            logger.warning("job %s of dead worker %s (pid %s) given back to its queue",
                           task_id, record.get("worker"), record.get("pid"))
            restored.append(str(task_id))
    return restored


def _release_lock(client: redis.Redis, key: str, token: str) -> None:
    """Delete ``key`` only if it still holds ``token`` (an overrun lock may be another's now)."""
    client.eval(_COMPARE_AND_DELETE, 1, key, token)


def resend_job(app: Celery, task_id: str, resend: dict[str, Any]) -> None:
    """Send a job again from its lease record: same task id, kwargs, queue, chord and group."""
    app.send_task(
        resend["name"], kwargs=resend.get("kwargs") or {}, task_id=task_id, queue=resend.get("queue"),
        chord=resend.get("chord"), group_id=resend.get("group_id"), group_index=resend.get("group_index"),
        root_id=resend.get("root_id"), parent_id=resend.get("parent_id"),
    )


class Reaper:
    """Runs :func:`reap_once` every ``interval_s``; a Redis lock keeps it to one reaper at a time."""

    def __init__(self, client: redis.Redis, app: Celery, interval_s: float) -> None:
        self._client = client
        self._app = app
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devicefleet-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        lock_ms = max(1000, int(self._interval * 5000))
        token = f"{host_name()}:{os.getpid()}:{uuid.uuid4().hex}"
        while not self._stop.wait(self._interval):
            try:
                if not self._client.set(REAPER_LOCK, token, nx=True, px=lock_ms):
                    continue
                try:
                    reap_once(self._client, self._app)
                finally:
                    _release_lock(self._client, REAPER_LOCK, token)
            except Exception as exc:  # Redis away, or a bad record: try again next round
                logger.warning("reaper round failed: %s", exc)
