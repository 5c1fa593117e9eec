"""``devicefleet user add|remove|list``: a fleet admin's users, each with credentials of their own.

Run with the fleet's own password (the admin's: the local fleet file, or ``DEVICEFLEET_REDIS_URL``
with the ``default`` user's password). ``add`` makes the user's Redis ACL user and signing key
(:mod:`tasks.core.users`) and writes their credentials file; ``remove`` deletes both (Redis closes
the user's open connections at once); ``list`` shows who is there. The fleet keeps its users in
Redis (:data:`~tasks.core.keys.FLEET_USERS`, persisted with the rest); each worker, as it joins
and every :data:`~tasks.core.defaults.ACL_USERS_CHECK_S` after (:mod:`tasks.worker.acl_keeper`),
makes their ACL users again on a Redis that lost them (a restart: ACL users are not in Redis's
data), from their password's hash (:func:`tasks.core.users.restore_acl_users`). On a fleet on
Sentinel, each user is made on the primary, each replica (ACL users are not replicated, and a
failover promotes a replica) and each sentinel (with the few ``SENTINEL`` reads a client asks:
:data:`~tasks.core.users.SENTINEL_USER_COMMANDS`), and her credentials' URL logs in to both.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from ..core.defaults import ACL_MIN_REDIS
from ..core.errors import ConfigError, CredentialsError
from ..core.keys import FLEET_USERS
from ..core.priority import check_user
from ..core.records import stored
from ..core.sentinel import SentinelURL, is_sentinel
from ..core.users import (
    Credentials,
    FleetUser,
    acl_rules,
    new_secret,
    on_peers,
    password_hash,
    sentinel_acl_rules,
    write_credentials,
)

logger = logging.getLogger(__name__)

#: The Redis ACL users that are never a fleet user's (the admin's own, and Redis's).
RESERVED_USERS = frozenset({"default"})


@dataclass(frozen=True)
class UserInfo:
    """One line of ``devicefleet user list``."""

    user: str
    team: str | None
    added_at: float
    acl_user: bool


def user_url(admin_url: str, user: str, password: str) -> str:
    """The fleet's Redis URL ``admin_url`` with ``user``'s ACL user and password in it (on
    Sentinel, her login to the sentinels too: her own ACL user there)."""
    if is_sentinel(admin_url):
        parsed = SentinelURL.parse(admin_url)
        return replace(parsed, username=user, password=password, sentinel_username=user,
                       sentinel_password=password).to_url()
    parts = urlsplit(admin_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_acl_support(client: Any) -> None:
    """Refuse a Redis too old for the users' rules (ACL selectors, read-only key patterns).

    Raises:
        ConfigError: the server is older than :data:`~tasks.core.defaults.ACL_MIN_REDIS`.
    """
    version = str(client.info("server").get("redis_version", "0"))
    have = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if have < ACL_MIN_REDIS:
        need = ".".join(map(str, ACL_MIN_REDIS))
        raise ConfigError(
            f"the fleet's Redis is {version}: users need Redis >= {need} (ACL selectors and "
            f"read-only key patterns). Run the fleet on a newer redis-server "
            "(DEVICEFLEET_REDIS_SERVER=/usr/bin/redis-server for `devicefleet up`)")


def add_user(client: Any, admin_url: str, user: str, *, team: str | None = None,
             output: Path | None = None) -> Credentials:
    """Add fleet user ``user`` (a new password and signing key if they exist already: their old
    credentials stop working) and write their credentials to ``output`` if given.

    Raises:
        ConfigError: ``user`` or ``team`` is not a user name, ``user`` is reserved, or the Redis
            is too old.
        CredentialsError: ``client`` is not the fleet admin's (the ACL command was refused).
    """
    check_user(user)
    if team is not None:
        check_user(team)
    if user in RESERVED_USERS:
        raise ConfigError(f"user {user!r} is reserved (Redis's own admin user): pick another name")
    if urlsplit(admin_url).scheme not in ("redis", "rediss") and not is_sentinel(admin_url):
        raise ConfigError(f"users on a {urlsplit(admin_url).scheme}:// fleet are not supported: add them on "
                          "a fleet on Redis (redis:// or rediss://) or Sentinel (sentinel://)")
    check_acl_support(client)
    password, signing_key = new_secret(), new_secret()
    record = FleetUser(team=team, signing_key=signing_key, added_at=time.time(), password_sha256=password_hash(password))
    try:
        client.execute_command("ACL", "SETUSER", user, *acl_rules(user, password))
    except redis.exceptions.NoPermissionError:
        raise CredentialsError("only the fleet's admin adds users: run `devicefleet user add` with the "
                               "fleet's own password (its fleet file, or DEVICEFLEET_REDIS_URL)") from None
    missed = on_peers(admin_url, lambda peer, on_sentinel: peer.execute_command(
        "ACL", "SETUSER", user, *(sentinel_acl_rules if on_sentinel else acl_rules)(user, password)))
    if missed:
        logger.warning("user %s: not made on %s: the running workers make it there when it answers", user,
                       "; ".join(missed))
    client.hset(FLEET_USERS, user, record.to_json())
    credentials = Credentials(user=user, team=team, redis_url=user_url(admin_url, user, password),
                              signing_key=signing_key)
    if output is not None:
        write_credentials(output, credentials)
    return credentials


def remove_user(client: Any, user: str, admin_url: str | None = None) -> bool:
    """Remove fleet user ``user``: their ACL user (Redis closes their connections) and signing
    key (their jobs not yet taken are refused); on a fleet on Sentinel (``admin_url``), their ACL
    users on its replicas and sentinels too. Whether they were there."""
    check_user(user)
    if user in RESERVED_USERS:
        raise ConfigError(f"user {user!r} is the fleet's admin, not a fleet user")
    removed = int(client.execute_command("ACL", "DELUSER", user))
    known = bool(int(client.hdel(FLEET_USERS, user)) or removed)
    missed = on_peers(admin_url, lambda peer, on_sentinel: peer.execute_command("ACL", "DELUSER", user)) \
        if admin_url is not None else []
    if missed:
        logger.warning("user %s: still on %s: remove it again when they answer", user, "; ".join(missed))
    return known


def list_users(client: Any) -> list[UserInfo]:
    """The fleet's users, by name."""
    acl = {name.decode() if isinstance(name, bytes) else str(name) for name in client.execute_command("ACL", "USERS")}
    out = []
    for name, raw in sorted(client.hgetall(FLEET_USERS).items()):
        user = name.decode() if isinstance(name, bytes) else str(name)
        record = stored(FleetUser, raw)
        out.append(UserInfo(user=user, team=record.team, added_at=record.added_at, acl_user=user in acl))
    return out
