"""Users who are who they say: each user of a fleet has credentials of their own (issue 49).

A fleet admin (the holder of the fleet's own password: the Redis ``default`` user) adds a user
with ``devicefleet user add alice`` (:mod:`tasks.ops.users`). That makes two things, as Slurm's
munge and a database's per-user login do together:

- a **Redis ACL user** ``alice`` with a password of her own, whose rules (:func:`acl_rules`) let
  her send work, watch it, read her own results and the fleet's status, and nothing else: no
  other user's results, progress or logs (their keys end in ``~<user>``: :func:`owned_task_id`),
  no purge (no command that takes from or empties a queue), no fleet key written (leases,
  registry, fencing), no Celery control broadcast (the pidbox: the channel cannot tell senders
  apart, so it is closed to users; see below);
- a **signing key**, kept by the fleet in :data:`~tasks.core.keys.FLEET_USERS` (which only the
  admin user reads) and given to her in her credentials file. Her producer signs each job it
  sends (:func:`job_signature`, over its task id and her name); a worker counts and runs a job
  as the user it names only if the signature holds (:class:`UserKeys`), so a message that names
  alice but was not signed with her key (``--user alice`` from bob, or bytes bob pushed himself)
  is refused with an error, never run as hers.

Why a signature as well as the ACL: the lists a message travels through are shared (a fan-out's
collect step, a job given back to its queue by a preemption or a dead worker's reaper), so the
list a worker popped a message from cannot say who sent it; a signature travels with the message
wherever it goes.

Cancelling: Celery's revoke is a broadcast on the pidbox channel, which cannot tell senders apart
(a worker obeys any revoke). Users are denied it (and ``mark_as_revoked``, a write of another
user's result key). A user cancels their own job with a signed :class:`CancelRequest` pushed to
:data:`~tasks.core.keys.CANCEL_REQUESTS`; a worker's relay (:mod:`tasks.worker.cancels`) checks
it names a job of theirs and sends the revoke with the fleet's own credentials.

With no user added, nothing here applies: the embedded single-user ``up`` and every fleet before
issue 49 keep today's behaviour (one password, the OS user's name, no signature).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import Field, ValidationError

from .defaults import ACL_USERS_CHECK_S, USER_KEYS_REFRESH_S
from .errors import CredentialsError
from .keys import CANCEL_REQUESTS, FLEET_USERS, OPTUNA_PREFIX, PREFIX
from .priority import USER_PATTERN
from .queue_lists import USER_SEPARATOR, split_level
from .queues import DEVICE_QUEUE_PREFIX, SWEEP_QUEUE_PREFIX, QueueName
from .records import _Record, stored
from .replies import text
from .sentinel import SentinelURL, is_sentinel

logger = logging.getLogger(__name__)

#: Environment variable and setting that name a user's credentials file.
CREDENTIALS_ENV = "DEVICEFLEET_CREDENTIALS"
#: The credentials file's name under ``$XDG_CONFIG_HOME/devicefleet`` (``~/.config``).
CREDENTIALS_FILE = "credentials.json"


class FleetUser(_Record):
    """What the fleet keeps of a user it knows (:data:`~tasks.core.keys.FLEET_USERS`)."""

    team: str | None = Field(default=None, pattern=USER_PATTERN)
    signing_key: str = Field(min_length=32)
    added_at: float
    #: SHA-256 of the user's Redis password (hex): their ACL user is made again from it
    #: (``#<hash>``) on a Redis that restarted without it (:func:`restore_acl_users`).
    password_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class Credentials(_Record):
    """A user's credentials file (mode 0600): who they are, their Redis URL (with their ACL user
    and password in it), and the key their jobs are signed with."""

    user: str = Field(pattern=USER_PATTERN)
    team: str | None = Field(default=None, pattern=USER_PATTERN)
    redis_url: str
    signing_key: str = Field(min_length=32)


def default_credentials_path() -> Path:
    """Where a user's producer looks for its credentials when none is named:
    ``$XDG_CONFIG_HOME/devicefleet/credentials.json`` (``~/.config/...``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "devicefleet" / CREDENTIALS_FILE


def read_credentials(path: Path) -> Credentials:
    """The credentials in ``path``.

    Raises:
        CredentialsError: the file is missing, unreadable or not a credentials file.
    """
    try:
        return Credentials.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise CredentialsError(
            f"credentials file {str(path)!r} does not exist: ask the fleet's admin to run "
            "`devicefleet user add <your name> --output <file>` and give you the file") from None
    except OSError as exc:
        raise CredentialsError(f"credentials file {str(path)!r} cannot be read ({exc.strerror})") from None
    except ValidationError:
        raise CredentialsError(
            f"{str(path)!r} is not a devicefleet credentials file: ask the fleet's admin for a new one "
            "(`devicefleet user add <your name> --output <file>`)") from None


def write_credentials(path: Path, credentials: Credentials) -> None:
    """Write ``credentials`` to ``path``, readable by its owner only (0600), whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(credentials.to_json())
    os.replace(tmp, path)


def new_secret() -> str:
    """A password or signing key: 32 random bytes, URL-safe."""
    return secrets.token_urlsafe(32)


def owned_task_id(user: str) -> str:
    """A new task id for a job of ``user``: ``<uuid>~<user>``, so that the keys named after it
    (its result ``celery-task-meta-<id>``, progress, log) match only ``user``'s key patterns."""
    return f"{uuid.uuid4()}{USER_SEPARATOR}{user}"


#: Between a sweep's or a study's name and its user's mark (:func:`owned_id`).
OWNER_MARK = ".u-"


def owner_suffix(user: str) -> str:
    """What ends the id of every sweep and study of ``user`` (:func:`owned_id`): ``.u-<hex of
    the name>``. Hex, because a user name may hold ``.``, ``-`` or ``@`` and the ``~`` of a task id
    would read as a queue's user list in a queue name: no suffix of one user's is another's, so
    the ACL patterns that end in it (:func:`acl_rules`) and the relay's check of an attach
    (:meth:`UserKeys.check_cancel`) match that user's only."""
    return f"{OWNER_MARK}{user.encode().hex()}"


def owned_id(name: str, user: str | None) -> str:
    """The id of ``user``'s sweep or study ``name`` (its record's keys, its own queue, its trial
    ids, its Optuna journal): ``name`` and :func:`owner_suffix`; ``name`` itself for the admin
    (``user`` None). Users' sweeps of one name are each their own."""
    return name if user is None else f"{name}{owner_suffix(user)}"


def optuna_prefix(user: str | None) -> str:
    """The key prefix of the Optuna journal a producer keeps its studies in: the fleet's
    (:data:`~tasks.core.keys.OPTUNA_PREFIX`), or, sent with ``user``'s credentials, that user's own."""
    return OPTUNA_PREFIX if user is None else f"{OPTUNA_PREFIX}{owner_suffix(user)}"


def job_signature(signing_key: str, task_id: str, user: str) -> str:
    """The signature of ``user``'s job ``task_id`` (:data:`~tasks.core.keys.SIGNATURE_HEADER`)."""
    return hmac.new(signing_key.encode(), f"{task_id} {user}".encode(), hashlib.sha256).hexdigest()


#: The queue lists' name prefixes (:mod:`tasks.core.queues`): a user may write to their own list
#: beside each (``cpu:batch~alice``) and read the length of any.
_QUEUE_PREFIXES = (QueueName.CPU.value, QueueName.GPU.value, QueueName.FLEET.value,
                   DEVICE_QUEUE_PREFIX, SWEEP_QUEUE_PREFIX)
#: The fleet's keys a user reads (``devicefleet status`` and ``tasks.waiting``: caps, leases,
#: usage, Xid counts; the producer's check of live workers and of kwargs against each job's
#: schema; fair share's order): never written by a user. They say who holds or used what, never
#: a job's arguments, results or logs.
_STATUS_KEYS = ("workers", "worker:*", "job-schemas:*", "device-state", "leases", "lease:*", "caps", "users",
                "usage*", "xid-counts", "user-seconds", "stats-devices", "stats:*", "finished:*", "wait:*",
                "reaper:stats", "dead-letters", "group*", "gang*", "claims:*", "preempt-claims:*",
                "waiting-users:*")
#: Commands a user's producer may run: reads, the publish of a job, a result's wait. No command
#: that takes from a list or empties one (purge), no KEYS/SCAN, no PUBLISH (Celery's control
#: broadcast), no MONITOR, CONFIG, ACL or FLUSH.
_READ_COMMANDS = ("get", "mget", "exists", "ttl", "pttl", "type", "strlen", "smembers", "sismember",
                  "smismember", "scard", "hget", "hgetall", "hkeys", "hvals", "hlen", "hmget", "hexists",
                  "llen", "scan", "zrange", "zrangebyscore", "zcard", "zcount", "zscore", "xrange", "xrevrange",
                  "xread", "xlen")
_CONNECTION_COMMANDS = ("ping", "hello", "auth", "select", "echo", "time", "info", "client|setname",
                        "client|id", "subscribe", "unsubscribe", "script|load",
                        "script|exists", "multi", "exec", "discard", "watch", "unwatch", "readonly",
                        # On Sentinel, a publish waits for a replica to have the message
                        # (tasks.core.sentinel.Replication): WAIT reads and writes no key.
                        "wait")


def password_hash(password: str) -> str:
    """What Redis keeps of a password (``ACL SETUSER u #<hash>`` sets it from this)."""
    return hashlib.sha256(password.encode()).hexdigest()


def acl_rules(user: str, password: str | None = None, *, hashed: str | None = None) -> list[str]:
    """The Redis ACL rules (``ACL SETUSER <user> <rules...>``, Redis >= 7.0) of fleet user ``user``.

    Root: the read commands over the fleet's status keys and her own results, progress and logs,
    read-only (``%R~``); her own queue lists (``cpu:batch~alice``), to push to; the chord state of
    her fan-outs (``celery-taskset-meta-*``: Celery names it by a group id it makes itself),
    kombu's binding sets, which every publish declares, and her sweeps' records and Optuna journal
    (keys that end in :func:`owner_suffix`). Selectors: a script call (``EVALSHA``)
    over any key, as every command a script runs is checked against these same rules (Redis 7),
    so a script can do no more than its caller (the publish script, the producer's read of the
    registry); the publish script's ``HSETNX`` of her name in the users hash, ``ZADD`` to a
    list's waiting users and ``LPUSH``/``LTRIM`` of a queue's wake marks, the only writes she may
    make to fleet keys; ``LRANGE`` and ``LINDEX`` of her own queue lists (her waiting
    jobs; of the others' lists, whose messages hold their jobs' arguments, she reads the lengths
    only). Channels: her results'.
    """
    sep, mark = USER_SEPARATOR, owner_suffix(user)
    own_lists = [f"~{prefix}*{sep}{user}" for prefix in _QUEUE_PREFIXES]
    # Her sweeps' records and sent sets, and her Optuna journal (tasks.producer.sweep, .optimize).
    own_trials = [f"~{PREFIX}sweep:*{mark}", f"~{PREFIX}sweep:*{mark}:sent", f"~{PREFIX}sweep:*{mark}:attached",
                  f"~{optuna_prefix(user)}:*"]
    secret = _secret(password, hashed)
    rules = ["reset", "on", secret, "resetchannels", "-@all",
             *(f"+{c}" for c in (*_CONNECTION_COMMANDS, *_READ_COMMANDS)), "+lpush", "+set", "+del",
             "+expire", "+pexpire", "+sadd", "+setnx", "+incr",
             *(f"%R~{PREFIX}{key}" for key in _STATUS_KEYS),
             f"%R~celery-task-meta-*{sep}{user}", f"%R~{PREFIX}progress:*{sep}{user}",
             f"%R~{PREFIX}log:*{sep}{user}",
             *(f"%R~{prefix}*" for prefix in _QUEUE_PREFIXES),
             *own_lists, *own_trials, "~celery-taskset-meta-*", "~_kombu.binding*",
             f"&celery-task-meta-*{sep}{user}",
             "(+evalsha +eval +evalsha_ro +eval_ro ~*)", f"(+lpush ~{CANCEL_REQUESTS})",
             # Her own queued jobs, read (``tasks.waiting``, the status' oldest): no other list's
             # messages (their jobs' arguments), only their lengths.
             "(+lrange +lindex " + " ".join(own_lists) + ")",
             f"(+hsetnx ~{PREFIX}users)", f"(+zadd ~{PREFIX}waiting-users:*)", f"(+lpush +ltrim ~{PREFIX}wake:*)"]
    return rules


def _secret(password: str | None, hashed: str | None) -> str:
    return f">{password}" if password is not None else f"#{hashed}"


#: What a user may ask a sentinel (a fleet on Sentinel): where the primary and its replicas are,
#: as redis-py's and kombu's Sentinel clients ask it, and nothing that changes a sentinel
#: (``FAILOVER``, ``SET``, ``MONITOR``, ``REMOVE``, ``CONFIG``, ``ACL``). Only what a Redis 7.0
#: sentinel knows (``CLIENT SETINFO``, which redis-py sends, came in 7.2; it ignores a refusal).
SENTINEL_USER_COMMANDS = ("auth", "hello", "ping", "client|setname", "client|getname",
                          "sentinel|get-master-addr-by-name", "sentinel|masters", "sentinel|master",
                          "sentinel|sentinels", "sentinel|replicas", "sentinel|slaves")


def sentinel_acl_rules(user: str, password: str | None = None, *, hashed: str | None = None) -> list[str]:
    """The ACL rules of fleet user ``user`` on each sentinel (``ACL SETUSER``, Redis >= 7.0):
    her password, and :data:`SENTINEL_USER_COMMANDS` only."""
    return ["reset", "on", _secret(password, hashed), "resetchannels", "-@all",
            *(f"+{command}" for command in SENTINEL_USER_COMMANDS)]


def on_peers(url: str, change: Callable[[Any, bool], object]) -> list[str]:
    """Call ``change(client, on_sentinel)`` on every other node a user's ACL user must be on: on
    a fleet on Sentinel (``url``, the admin's), each replica of the primary (ACL users are not
    replicated, and a failover promotes one) and each sentinel (the users' producers ask them
    where the primary is); none on a fleet with one Redis. The nodes it could not reach or that
    refused, each ``host:port (why)``: the running workers make their users again there within
    :data:`~tasks.core.defaults.ACL_USERS_CHECK_S` of their answering."""
    if not is_sentinel(url):
        return []
    parsed = SentinelURL.parse(url)
    missed: list[str] = []
    nodes = [(host, port, False) for host, port in parsed.replicas()]
    nodes += [(host, port, True) for host, port in parsed.sentinels]
    for host, port, on_sentinel in nodes:
        client = parsed.sentinel_client(host, port) if on_sentinel else parsed.node_client(host, port)
        try:
            change(client, on_sentinel)
        except redis.RedisError as exc:
            missed.append(f"{host}:{port} ({type(exc).__name__}: {exc})")
        finally:
            client.close()
    return missed


def restore_acl_users(client: Any, url: str | None = None, *, missing_only: bool = False) -> list[str]:
    """Make again, from :data:`~tasks.core.keys.FLEET_USERS`, the ACL user of each fleet user the
    Redis lacks (a Redis restarted from its data keeps the fleet's keys, not its ACL users), with
    the same password (from its hash) and rules; the users made again. Unless ``missing_only``,
    the users it has get this version's rules too (a user added by an older one may lack a read
    that its status needs), with the same password: their open connections stay. On a fleet on
    Sentinel (``url``), the same on each replica and sentinel (:func:`on_peers`; one out of reach
    is logged and skipped). Run with the fleet's own password by each worker as it joins, and
    with ``missing_only`` every :data:`~tasks.core.defaults.ACL_USERS_CHECK_S` after (one
    ``ACL USERS`` a node). One read (``HGETALL``) on a fleet with no users."""
    records = client.hgetall(FLEET_USERS)
    if not records:
        return []
    hashes: dict[str, str] = {}
    for name, raw in records.items():
        try:
            record = stored(FleetUser, raw)
        except ValidationError:
            continue
        if record.password_sha256 is not None:
            hashes[text(name)] = record.password_sha256

    def give(node: Any, rules: Callable[..., list[str]]) -> list[str]:
        have = {text(name) for name in node.execute_command("ACL", "USERS")}
        for user, hashed in hashes.items():
            if user not in have or not missing_only:
                node.execute_command("ACL", "SETUSER", user, *rules(user, hashed=hashed))
        return [user for user in hashes if user not in have]

    made = give(client, acl_rules)
    if url is not None and hashes:
        missed = on_peers(url, lambda peer, on_sentinel: give(peer, sentinel_acl_rules if on_sentinel else acl_rules))
        if missed:  # a warning as a worker joins; then, every few seconds while a node is away, a debug line
            (logger.debug if missing_only else logger.warning)(
                "could not give the users' ACL users to %s: tried again in %g s", "; ".join(missed), ACL_USERS_CHECK_S)
    return made


class UserKeys:
    """A worker's copy of the users' signing keys (:data:`~tasks.core.keys.FLEET_USERS`), read
    again every :data:`~tasks.core.defaults.USER_KEYS_REFRESH_S` and whenever a job names a user
    it does not know: no round trip per job otherwise."""

    def __init__(self, refresh_s: float = USER_KEYS_REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._keys: dict[str, str] = {}
        self._read_at: float | None = None

    def _read(self, client: Any) -> None:
        keys: dict[str, str] = {}
        for name, raw in client.hgetall(FLEET_USERS).items():
            try:
                keys[text(name)] = stored(FleetUser, raw).signing_key
            except ValidationError:
                continue  # a record this version cannot read: its user's jobs are refused
        self._keys, self._read_at = keys, time.monotonic()

    def _fresh(self, client: Any) -> None:
        if self._read_at is None or time.monotonic() - self._read_at >= self.refresh_s:
            self._read(client)

    def any(self, client: Any) -> bool:
        """Whether the fleet has users (as of the last read)."""
        self._fresh(client)
        return bool(self._keys)

    def knows(self, user: str | None) -> bool:
        """Whether ``user`` is a user of the fleet as of the last read (after :meth:`check`, a
        job's signature as ``user`` held)."""
        return user is not None and user in self._keys

    def check_cancel(self, client: Any, request: CancelRequest) -> str | None:
        """Why ``request`` may not be relayed (``None``: it may): it must be signed by its user,
        and name a job of theirs (a task id that ends in ``~<user>``: :func:`owned_task_id`), or,
        to attach or detach workers, the own queue of a sweep or study of theirs (a ``sweep.``
        list whose id ends in :func:`owner_suffix`)."""
        self._fresh(client)
        if request.user not in self._keys:
            self._read(client)
        key = self._keys.get(request.user)
        if key is None:
            return f"user {request.user!r} is not a user of the fleet"
        if not hmac.compare_digest(request.signature, relay_signature(key, request)):
            return f"the request is not signed with {request.user}'s key"
        if request.action == "cancel":
            if not request.task_id.endswith(f"{USER_SEPARATOR}{request.user}"):
                return f"job {request.task_id} is not {request.user}'s"
            return None
        queue = split_level(request.task_id)[0]  # a level's list of the queue, never a user's list of it
        if USER_SEPARATOR in request.task_id or not (
                queue.startswith(SWEEP_QUEUE_PREFIX) and queue.endswith(owner_suffix(request.user))):
            return f"queue {request.task_id} is not the queue of a sweep or study of {request.user}'s"
        return None

    def check(self, client: Any, task_id: str, user: str | None, signature: Any) -> str | None:
        """Why the job ``task_id`` may not run as ``user`` (``None``: it may).

        With no user added to the fleet, every job may (today's single-user fleet). Otherwise a
        job that names a user the fleet knows must carry that user's signature; a signed job must
        name a user the fleet knows; a job that names no user, or a user the fleet does not know,
        unsigned, is the admin's (who holds the fleet's password) and runs as it says.
        """
        self._fresh(client)
        if user is not None and user not in self._keys and signature is not None:
            self._read(client)  # added since the last read
        if not self._keys or user is None and signature is None:
            return None
        if user is None:
            return "the job is signed but names no user"
        key = self._keys.get(user)
        if key is None:
            return None if signature is None else (
                f"the job is signed as user {user!r}, whom the fleet does not know (removed?): "
                f"`devicefleet user add {user}` on the fleet's admin host")
        if not isinstance(signature, str) or not hmac.compare_digest(signature, job_signature(key, task_id, user)):
            return (f"the job names user {user!r} but was not sent with {user}'s credentials: a user's "
                    f"jobs are sent with their own credentials file (`devicefleet user add {user}`)")
        return None


class CancelRequest(_Record):
    """A user's request that a worker's relay acts for them with the fleet's credentials
    (:data:`~tasks.core.keys.CANCEL_REQUESTS`, :mod:`tasks.worker.cancels`): ``cancel`` their job
    ``task_id`` (Celery's revoke; with ``store``, its ``REVOKED`` result stored too unless it runs:
    a sweep's trial that may never be taken), or ``attach`` / ``detach`` the workers ``workers``
    to / from their sweep's own queue list ``task_id`` (Celery's ``add_consumer`` and
    ``cancel_consumer``, broadcasts a user may not send)."""

    task_id: str = Field(min_length=1, max_length=300)
    user: str = Field(pattern=USER_PATTERN)
    signature: str
    action: Literal["cancel", "attach", "detach"] = "cancel"
    store: bool = False
    workers: tuple[str, ...] = ()


def _relay_message(request: CancelRequest) -> str:
    """What a relay request's signature is over: its action, target, and what it asks besides."""
    return (f"{request.action} {request.task_id}" + (" store" if request.store else "")
            + (f" to {','.join(request.workers)}" if request.workers else ""))


def relay_signature(signing_key: str, request: CancelRequest) -> str:
    """The signature ``request`` must carry: its user's, over :func:`_relay_message`."""
    return job_signature(signing_key, _relay_message(request), request.user)


def cancel_request(credentials: Credentials, task_id: str, *, store: bool = False) -> CancelRequest:
    """The request, signed, to cancel job ``task_id`` of the credentials' user (``store``: see
    :class:`CancelRequest`)."""
    return relay_request(credentials, "cancel", task_id, store=store)


def relay_request(credentials: Credentials, action: Literal["cancel", "attach", "detach"], target: str, *,
                  store: bool = False, workers: tuple[str, ...] = ()) -> CancelRequest:
    """The credentials' user's request, signed, that a relay does ``action`` on ``target``."""
    unsigned = CancelRequest(task_id=target, user=credentials.user, signature="", action=action, store=store,
                             workers=workers)
    return unsigned.model_copy(update={"signature": relay_signature(credentials.signing_key, unsigned)})


def denial(exc: BaseException, user: str | None) -> CredentialsError | None:
    """The one-line error for Redis refusing ``user``'s credentials or command (``WRONGPASS``,
    ``NOPERM``; raw, or wrapped by kombu or Celery), or None: ``exc`` is no such refusal."""
    seen: BaseException | None = exc
    while seen is not None:
        said = str(seen)
        who = f"user {user!r}" if user else "the fleet's password"
        if "WRONGPASS" in said or "invalid username-password" in said or "user is disabled" in said:
            return CredentialsError(
                f"Redis refused the credentials of {who} (wrong, revoked or removed): ask the fleet's "
                f"admin for new ones (`devicefleet user add {user or '<your name>'}` on the fleet's admin host)")
        if "NOPERM" in said or "no permissions" in said:
            return CredentialsError(
                f"{who} may not do this: a user's credentials send, watch, read and cancel their own jobs "
                f"only, and read the fleet's status ({said.strip()}); the fleet's admin holds the rest")
        seen = seen.__cause__ or seen.__context__
    return None
