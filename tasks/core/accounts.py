"""Each fleet user's jobs run as that user's own system account (the ``job_accounts`` setting).

A job process runs many jobs of one user (:mod:`tasks.worker.owners`), but on a deployed host it
ran them as the worker's one system account: every user's job could read the artifacts and
checkpoints of every other user's. With ``job_accounts`` (``alice=devicefleet-alice,...``;
``devicefleet deploy --job-account alice`` renders the accounts, their folders and the worker's
capabilities) a user's job processes start as the user's account: its uid and group, no
supplementary group, umask 077, ``HOME`` its folder; and the job's artifacts (checkpoints, logs,
curves) go to that folder, ``<artifacts>/users/<user>``, which only the account may open (0700).

The worker holds what starting them takes and no more (:data:`WORKER_CAPABILITIES`: under systemd
as ambient capabilities of its unprivileged account). A job process gets none of them: the kernel
clears a process's capabilities across a uid change only when it leaves uid 0, so the child
empties its sets (the ambient one, which an ``exec`` would hand on, and the permitted, effective
and inheritable ones) before the ``exec`` (:func:`tasks.core.children.spawn_child`), and the job
process checks first thing that it holds none (:func:`own_capabilities`), refusing to start
otherwise: fail closed.

Who a job is for comes from the credentials that sent it (:class:`tasks.core.users.UserKeys`): a
job runs as a user's account only when that user's signature holds; a job of a user of the fleet
the mapping does not name is refused (:class:`~tasks.core.errors.NoJobAccount`), never run as
someone else; a job that names no user of the fleet (the admin's, sent with the fleet's password)
runs as the worker's own account, as every job did before.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, NoJobAccount

#: Where a user's jobs write, under the artifacts folder: ``<artifacts>/users/<user>``.
USERS_SUBDIR = "users"
#: A system account's name (useradd's and systemd-sysusers' rule, at most 32 characters).
ACCOUNT_PATTERN = r"^[a-z_][a-z0-9_-]{0,31}$"

#: Capability numbers (<linux/capability.h>) the worker needs to start and watch job processes
#: of other accounts: to set their uid and groups, to signal them (stop, preempt, kill), and to
#: read their /proc entries under ``ProtectProc=invisible`` (their memory, against a slot's budget).
CAPABILITY_NUMBERS = {"CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SYS_PTRACE": 19}
WORKER_CAPABILITIES = tuple(CAPABILITY_NUMBERS)


@dataclass(frozen=True)
class JobAccount:
    """The system account a user's job processes run as, as this host knows it."""

    user: str
    account: str
    uid: int
    gid: int
    #: The user's own folder: their jobs' artifacts, and ``HOME``.
    folder: Path


def user_folder(artifacts: Path, user: str) -> Path:
    """Where ``user``'s jobs write their artifacts under job accounts."""
    return artifacts / USERS_SUBDIR / user


def held_capabilities(status: str) -> dict[str, int]:
    """The capability sets in ``/proc/<pid>/status`` text (``CapInh``, ``CapPrm``, ``CapEff``,
    ``CapAmb``), as bit masks; a set the kernel does not list is left out."""
    held: dict[str, int] = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
            held[name] = int(value.strip(), 16)
    return held


def own_capabilities(status_path: str = "/proc/self/status") -> dict[str, int]:
    """This process's capability sets (:func:`held_capabilities` of its ``/proc`` status); empty
    where there is no ``/proc`` to read (not Linux: no capabilities)."""
    try:
        with open(status_path, encoding="ascii") as status:
            return held_capabilities(status.read())
    except OSError:
        return {}


def missing_worker_capabilities(effective: int) -> list[str]:
    """The :data:`WORKER_CAPABILITIES` not in the ``effective`` mask (a root worker has them all)."""
    return [name for name, bit in CAPABILITY_NUMBERS.items() if not effective >> bit & 1]


def check_worker_capabilities(status_path: str = "/proc/self/status") -> None:
    """Check that this process may start job processes as other accounts.

    Raises:
        ConfigError: it lacks some of :data:`WORKER_CAPABILITIES`; the message names them.
    """
    missing = missing_worker_capabilities(own_capabilities(status_path).get("CapEff", 0))
    if missing:
        raise ConfigError(
            f"job_accounts maps users to system accounts, but this worker lacks {', '.join(missing)}, which "
            "starting and watching job processes as those accounts takes: run it under the unit `devicefleet "
            "deploy --job-account` renders (its drop-in gives them), or unset DEVICEFLEET_JOB_ACCOUNTS")


class JobAccounts:
    """A worker's map of fleet users to system accounts (empty: every job runs as the worker)."""

    def __init__(self, mapping: Mapping[str, str], artifacts: Path) -> None:
        self.mapping = dict(mapping)
        self.artifacts = artifacts

    def __bool__(self) -> bool:
        return bool(self.mapping)

    def refusal(self, user: str | None, verified: bool) -> str | None:
        """Why a job of ``user`` may not run here (None: it may). ``verified``: ``user`` is a
        user of the fleet and their credentials sent it (:meth:`tasks.core.users.UserKeys.check`).

        A user of the fleet runs only as their own account: one this host does not map is
        refused. A mapped account runs only a verified user's jobs. A job that names no user of
        the fleet is the admin's (sent with the fleet's password) and runs as the worker."""
        if not self.mapping or not user:
            return None
        account = self.mapping.get(user)
        if verified and account is None:
            return (f"this host runs each user's jobs as the user's own system account and maps none to "
                    f"user {user!r} (it maps {', '.join(sorted(self.mapping))}): map it with `devicefleet "
                    f"deploy --job-account {user}` (the job_accounts setting, DEVICEFLEET_JOB_ACCOUNTS)")
        if not verified and account is not None:
            return (f"user {user!r} is not a user of the fleet, so a job that names them cannot run as "
                    f"their system account {account!r}: add them with `devicefleet user add {user}` and "
                    "send with their credentials")
        return None

    def resolve(self, user: str) -> JobAccount | None:
        """The account ``user``'s job processes start as; None: the worker's own (a job of no
        user the mapping names: the admin's, :meth:`refusal`).

        Raises:
            NoJobAccount: the account does not exist on this host, or the user's folder is
                missing or open to others.
        """
        name = self.mapping.get(user) if user else None
        if name is None:
            return None
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise NoJobAccount(f"system account {name!r} of user {user!r} does not exist on this host: create "
                               "it (`devicefleet deploy --job-account` renders it for systemd-sysusers)") from None
        folder = user_folder(self.artifacts, user)
        try:
            info = os.stat(folder)
        except OSError as exc:
            raise NoJobAccount(f"user {user!r}'s folder {folder} cannot be read ({exc.strerror}): create it, "
                               f"owned by {name} with mode 0700 (`devicefleet deploy --job-account` renders it "
                               "for systemd-tmpfiles)") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != entry.pw_uid or info.st_mode & 0o077:
            raise NoJobAccount(f"user {user!r}'s folder {folder} must be a folder owned by {name} that only it "
                               f"may open (mode 0700); it is owned by uid {info.st_uid} with mode "
                               f"{stat.S_IMODE(info.st_mode):04o}")
        return JobAccount(user=user, account=name, uid=entry.pw_uid, gid=entry.pw_gid, folder=folder)


def check_account_name(name: str) -> str:
    """``name`` if it is a system account's name.

    Raises:
        ValueError: it is not; the message names it.
    """
    if not re.fullmatch(ACCOUNT_PATTERN, name):
        raise ValueError(f"system account {name!r} is not an account name (lower-case letters, digits, '_' "
                         "and '-', at most 32, starting with a letter or '_')")
    return name
