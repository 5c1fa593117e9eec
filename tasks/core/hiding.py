"""The fleet's secrets, and how a process of the fleet hides them from other processes.

Every long-lived process of a fleet that holds what opens its Redis (a device worker, the
``devicefleet up`` launcher, Flower, the metrics exporter) runs as the same user as the jobs of
that host, and a job can read what that user can: another process's ``/proc/<pid>/environ``
and ``cmdline``, and its memory. Each such process calls :func:`hide_from_children` with its
secrets (:func:`fleet_secrets` of its Redis URL, :func:`environment_secrets` of its
environment) as soon as it knows them.

What this does not close: files of that user (a local fleet's ``fleet.json`` and embedded
Redis config, both 0600) stay readable to a job of the same user; only another user closes
those (workers deployed by ``devicefleet deploy`` run as their own system user, and their
units hide the environment files: ``deploy/devicefleet-worker@.service``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit

from .sentinel import SentinelURL, is_sentinel

logger = logging.getLogger(__name__)

#: A secret shorter than this is not looked for in other variables' values (a one-letter
#: password would drop half the environment; such a password is no secret anyway).
MIN_SECRET_CHARS = 4
#: The fleet's Redis URL (with its password), as every fleet process reads it.
REDIS_URL_ENV = "DEVICEFLEET_REDIS_URL"
#: Flower's login (``user:password``, comma-separated for several), Flower's own variable.
FLOWER_AUTH_ENV = "FLOWER_BASIC_AUTH"


def fleet_secrets(url: str | None) -> list[str]:
    """What opens the fleet's Redis at ``url``: the URL itself and each password in it."""
    if not url:
        return []
    secrets = [url]
    try:
        if is_sentinel(url):
            parsed = SentinelURL.parse(url)
            secrets += [s for s in (parsed.password, parsed.sentinel_password) if s]
        else:
            password = urlsplit(url).password
            if password:
                secrets += [password, unquote(password)]
    except ValueError:  # a malformed URL: the worker refuses it elsewhere; the URL is still hidden
        pass
    return _long_enough(secrets)


def login_secrets(basic_auth: str | None) -> list[str]:
    """What opens Flower with ``basic_auth`` (``user:password[,user:password...]``): the value
    and each password. Flower's login is a key to the fleet too: Flower can revoke jobs and shut
    workers down."""
    if not basic_auth:
        return []
    secrets = [basic_auth]
    for login in basic_auth.split(","):
        secrets.append(login.partition(":")[2])
    return _long_enough(secrets)


def environment_secrets(env: Mapping[str, str] | None = None) -> list[str]:
    """The fleet's secrets in ``env`` (default ``os.environ``): those of its Redis URL and of
    Flower's login."""
    env = os.environ if env is None else env
    return list(dict.fromkeys([*fleet_secrets(env.get(REDIS_URL_ENV)), *login_secrets(env.get(FLOWER_AUTH_ENV))]))


def holds_secret(value: str, secrets: Iterable[str]) -> bool:
    return any(secret in value for secret in secrets)


def _long_enough(secrets: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(s for s in secrets if len(s) >= MIN_SECRET_CHARS))


def hide_from_children(secrets: Iterable[str]) -> None:
    """Close this process's keys to its children and to every other process of its user (Linux).

    - ``prctl(PR_SET_DUMPABLE, 0)``: a process of the same user, job processes included, can
      no longer read its ``/proc/<pid>/environ`` or memory, nor ptrace it (nor can ``py-spy``
      as that user: profile such a process as root);
    - the ``secrets`` are overwritten with ``*`` in its initial environment and argument blocks
      (what ``/proc/<pid>/environ`` and ``/proc/<pid>/cmdline`` show, to root as well, and the
      cmdline to every user): ``os.environ`` is Python's copy, and keeps them.

    No secrets (no fleet, e.g. an in-process check of the jobs): nothing is done, and py-spy
    still works.
    """
    import ctypes
    import ctypes.util

    needles = [secret.encode() for secret in secrets]
    if not needles:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if int(libc.prctl(4, 0, 0, 0, 0)) != 0:  # PR_SET_DUMPABLE = 4
            logger.warning("prctl(PR_SET_DUMPABLE, 0) failed (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        logger.warning("could not make this process non-dumpable: %s", exc)
    try:
        with open("/proc/self/stat", "rb") as handle:
            # proc(5): after the command's ")", field 3 on; arg_start..env_end are fields 48-51.
            fields = handle.read().rsplit(b")", 1)[1].split()
        blocks = {"cmdline": (int(fields[45]), int(fields[46])), "environ": (int(fields[47]), int(fields[48]))}
        for name, (start, end) in blocks.items():
            with open(f"/proc/self/{name}", "rb") as handle:
                shown = handle.read()
            # Only where the block is what /proc shows (else the addresses are not what they seem).
            if end <= start or ctypes.string_at(start, end - start) != shown[:end - start]:
                logger.warning("could not hide the fleet's secrets in /proc/self/%s", name)
                continue
            for needle in needles:
                at = shown.find(needle)
                while at >= 0:
                    ctypes.memset(start + at, ord("*"), len(needle))
                    at = shown.find(needle, at + len(needle))
    except (OSError, ValueError, IndexError) as exc:
        logger.warning("could not hide the fleet's secrets from /proc: %s", exc)


__all__ = [
    "environment_secrets",
    "fleet_secrets",
    "hide_from_children",
    "holds_secret",
    "login_secrets",
]
