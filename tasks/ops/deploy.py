"""Render the systemd units and config files of one host from the templates in ``deploy/``.

``devicefleet deploy`` calls :func:`plan_host` then :func:`render`. The templates are real,
commented files in ``deploy/`` that an operator can read; ``{{ name }}`` placeholders are the
only thing filled in. A host gets:

- ``devicefleet-worker@.service`` (the worker of one device per instance) and, per instance,
  drop-ins with its stop timeout (and, for a GPU, access to the NVIDIA devices; for a worker
  whose config allows commands, the folders they may run in, made writable in the sandbox);
- on a host with two GPUs or more, ``devicefleet-groups.service`` (the group host, where GPU
  device groups' job processes run, behind a device policy that opens every GPU of the host)
  and ``devicefleet-worker@.socket`` (each GPU worker's socket, on which the group host
  connects: :mod:`tasks.worker.group_host`);
- ``devicefleet-flower.service``, ``devicefleet-metrics.service`` (the Prometheus exporter) and
  ``devicefleet.target`` (wants every unit of this host);
- ``devicefleet.env`` and ``flower.env`` (fleet-wide settings, secrets: 0640, and hidden from
  the workers and their jobs, which run as the same user: ``InaccessiblePaths=``);
- ``/etc/sysusers.d/`` and ``/etc/tmpfiles.d/`` entries: the units' system user and the folders
  it may write;
- a copy of ``worker_configs/`` (the units read this copy; edits there are kept);
- for the host that runs Redis: a snippet for Debian's ``redis-server`` (bind, password,
  append-only, and TLS when other hosts join);
- on the three (or five...) hosts of a Redis Sentinel layout (``--sentinel``, then ``--join
  sentinel://... --this-host``): the Redis snippet of a primary or replica, the config of Debian's
  ``redis-sentinel``, and drop-ins that start both once the network is up.

Paths in the plan are where files live on the target system; :func:`render` writes them under
``root`` (``/`` on the host itself, a review folder otherwise).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from ..core.accounts import USERS_SUBDIR, WORKER_CAPABILITIES, check_account_name, user_folder
from ..core.commands import CommandPolicy
from ..core.defaults import (
    CANCEL_GRACE_S,
    MAX_JOB_SECONDS,
    SENTINEL_DOWN_AFTER_MS,
    SENTINEL_FAILOVER_TIMEOUT_MS,
    STOP_MARGIN_S,
)
from ..core.devices import Device, DeviceKind, DeviceNames
from ..core.errors import ConfigError
from ..core.priority import check_user
from ..core.sentinel import DEFAULT_PORT as DEFAULT_SENTINEL_PORT
from ..core.sentinel import SentinelURL, is_sentinel
from ..core.settings import ARTIFACTS_SUBDIR, DEFAULT_METRICS_PORT, check_redis_auth
from ..core.worker_config import config_file, load_worker_config

logger = logging.getLogger(__name__)

WORKER_UNIT = "devicefleet-worker@.service"
#: The group host, where GPU device groups' job processes run, on a host with two GPUs or more;
#: it connects to each GPU worker's socket (tasks.worker.group_host).
GROUP_UNIT = "devicefleet-groups.service"
GROUP_SOCKET_UNIT = "devicefleet-worker@.socket"
#: The worker template's sandbox, which the group unit copies: from this line to ``[Install]``.
SANDBOX_START = "# Hardening:"
FLOWER_UNIT = "devicefleet-flower.service"
METRICS_UNIT = "devicefleet-metrics.service"
TARGET_UNIT = "devicefleet.target"
#: Folders a unit with ``ProtectHome`` and ``PrivateTmp`` does not see. Code installed there (a
#: venv under /root or /home, a checkout or CI venv under /tmp) is bound back in read-only.
HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
HIDDEN_ROOTS = (*HOME_ROOTS, Path("/tmp"), Path("/var/tmp"))
REDIS_UNIT = "redis-server.service"
SENTINEL_UNIT = "redis-sentinel.service"
#: The name the sentinels monitor the primary under (``master_name=`` in the URL).
MASTER_NAME = "devicefleet"
#: The sentinel's config as rendered, copied once over Debian's ``/etc/redis/sentinel.conf``.
SENTINEL_FILE = "sentinel-devicefleet.conf"
#: The folder that holds the ``tasks`` package (tasks/ops/deploy.py is two levels down): the
#: checkout, for an editable install.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REDIS_PORT = 6379
DEFAULT_REDIS_TLS_PORT = 6380

_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
# Characters an EnvironmentFile value or a unit line cannot carry as is ($ expands there).
_UNSAFE = re.compile(r"[\s\"'\\$`%]")


def templates_dir() -> Path:
    """The ``deploy/`` folder: next to the package in a checkout, inside it in a wheel.

    Raises:
        ConfigError: neither is there.
    """
    package = Path(__file__).resolve().parent.parent  # tasks/
    for candidate in (package.parent / "deploy", package / "_deploy"):
        if (candidate / WORKER_UNIT).is_file():
            return candidate
    raise ConfigError(f"no deploy/ templates found next to {package}")


def fill(text: str, values: dict[str, object]) -> str:
    """Replace every ``{{ name }}`` in ``text``.

    Raises:
        ConfigError: a placeholder has no value (a template and this module disagree).
    """

    def one(match: re.Match[str]) -> str:
        name = match[1]
        if name not in values:
            raise ConfigError(f"deploy template placeholder {{{{ {name} }}}} has no value")
        return str(values[name])

    return _PLACEHOLDER.sub(one, text)


def _check_safe(name: str, value: str) -> str:
    if _UNSAFE.search(value):
        raise ConfigError(
            f"{name}={value!r} contains a space, quote, backslash, $, ` or %, which systemd "
            "would expand or split; percent-encode it in the URL or choose another value"
        )
    return value


@dataclass
class HostPlan:
    """What to render for one host. Paths are those on the target system."""

    devicefleet_bin: Path
    #: The Python of ``devicefleet_bin``'s environment (Flower's unit runs Celery with it).
    python_bin: Path
    worker_configs_src: Path
    cpu_workers: int = 1
    gpus: int = 0
    user: str = "devicefleet"
    config_dir: Path = Path("/etc/devicefleet")
    unit_dir: Path = Path("/etc/systemd/system")
    redis_conf_dir: Path = Path("/etc/redis")
    state_dir: Path = Path("/var/lib/devicefleet")
    #: Where the GPU workers' sockets for the group host are (hidden from every worker unit).
    group_socket_dir: Path = Path("/run/devicefleet/groups")
    artifacts_dir: Path | None = None
    #: Join this Redis (another host's). None: this host runs Redis (Debian's redis-server).
    join_url: str | None = None
    #: Address other hosts reach this host's Redis on (TLS); None: loopback only.
    serve_address: str | None = None
    redis_port: int = DEFAULT_REDIS_PORT
    redis_tls_port: int = DEFAULT_REDIS_TLS_PORT
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    #: A Redis Sentinel layout: every host's address, the first one's Redis the initial primary.
    sentinel_hosts: tuple[str, ...] = ()
    #: This host's address in :attr:`sentinel_hosts` when it runs a Redis and a sentinel there.
    this_host: str | None = None
    sentinel_port: int = DEFAULT_SENTINEL_PORT
    sentinel_password: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    master_name: str = MASTER_NAME
    device_names: DeviceNames = DeviceNames.SHORT
    device_host: str = field(default_factory=socket.gethostname)
    stop_margin_s: int = STOP_MARGIN_S
    flower_address: str = "127.0.0.1"
    flower_port: int = 5555
    metrics_port: int = DEFAULT_METRICS_PORT
    flower_auth: str = field(default_factory=lambda: f"admin:{secrets.token_urlsafe(18)}")
    #: Folders the units run code from (the binaries' environment, the interpreter, the package).
    code_dirs: list[Path] = field(default_factory=list)
    #: Fleet users whose jobs run as a system account of their own (:mod:`tasks.core.accounts`).
    job_users: tuple[str, ...] = ()

    @property
    def job_accounts(self) -> dict[str, str]:
        """Each of :attr:`job_users` and their system account, ``<user>-<fleet user>``."""
        return {name: f"{self.user}-{name}" for name in self.job_users}

    @property
    def hidden_code_dirs(self) -> list[Path]:
        """The :attr:`code_dirs` the units' sandbox hides, outermost only: bound back read-only."""
        hidden = sorted({d for d in self.code_dirs if any(d.is_relative_to(r) for r in HIDDEN_ROOTS)})
        return [d for d in hidden if not any(d != o and d.is_relative_to(o) for o in hidden)]

    @property
    def devices(self) -> list[str]:
        """The worker instances of this host: ``cpu0..``, then ``gpu0..``."""
        return [f"cpu{i}" for i in range(self.cpu_workers)] + [f"gpu{i}" for i in range(self.gpus)]

    @property
    def runs_groups(self) -> bool:
        """Whether this host runs a group host: GPU groups need one, and two GPUs to be one."""
        return self.gpus >= 2

    @property
    def gpu_devices(self) -> list[str]:
        return [f"gpu{i}" for i in range(self.gpus)]

    @property
    def runs_redis(self) -> bool:
        return self.join_url is None or self.this_host is not None

    @property
    def runs_sentinel(self) -> bool:
        """Whether this host runs a Redis and a sentinel of a Sentinel layout."""
        return self.this_host is not None

    @property
    def primary(self) -> str:
        """The initial primary of a Sentinel layout (the sentinels move it on a failover)."""
        return self.sentinel_hosts[0]

    @property
    def local_units(self) -> list[str]:
        """Debian's units of this host that the fleet's units start after."""
        if self.runs_sentinel:
            return [REDIS_UNIT, SENTINEL_UNIT]
        return [REDIS_UNIT] if self.runs_redis else []

    @property
    def sysusers_file(self) -> Path:
        return Path("/etc/sysusers.d") / f"{self.user}.conf"

    @property
    def tmpfiles_file(self) -> Path:
        return Path("/etc/tmpfiles.d") / f"{self.user}.conf"

    @property
    def artifacts(self) -> Path:
        return self.artifacts_dir or self.state_dir / ARTIFACTS_SUBDIR

    @property
    def redis_url(self) -> str:
        """The URL every unit of this host uses."""
        if self.join_url is not None:
            return self.join_url
        if self.sentinel_hosts:
            return SentinelURL(
                sentinels=tuple((host, self.sentinel_port) for host in self.sentinel_hosts),
                master_name=self.master_name, password=self.redis_password,
                sentinel_password=self.sentinel_password,
            ).to_url()
        password = quote(self.redis_password, safe="")
        if self.serve_address is None:
            return f"redis://:{password}@127.0.0.1:{self.redis_port}/0"
        ca = quote(str(self.config_dir / "tls" / "ca.crt"), safe="")
        return (f"rediss://:{password}@{self.serve_address}:{self.redis_tls_port}/0"
                f"?ssl_cert_reqs=required&ssl_ca_certs={ca}")


@dataclass
class Rendered:
    """The outcome of :func:`render`: files written (target paths) and commands to run."""

    files: list[Path]
    kept: list[Path]
    commands: list[str]
    units: list[str]


def plan_host(
    *,
    gpus: int | None = None,
    cpu_workers: int = 1,
    join_url: str | None = None,
    serve_address: str | None = None,
    sentinel_hosts: Sequence[str] | None = None,
    this_host: str | None = None,
    device_names: DeviceNames | None = None,
    root: Path = Path("/"),
    worker_configs_src: Path | None = None,
    devicefleet_bin: Path | None = None,
    job_users: Sequence[str] = (),
    **paths: object,
) -> HostPlan:
    """A :class:`HostPlan` for this host: one CPU worker and one worker per GPU by default.

    ``sentinel_hosts`` (``--sentinel``) renders the first host of a Sentinel layout, the initial
    primary; ``join_url`` a ``sentinel://`` URL with ``this_host`` (``--join URL --this-host``)
    renders one of the others, a replica, with the URL's passwords.

    An existing rendering under ``root`` keeps its Redis password, sentinels' password and Flower
    login, so that rendering again never locks out the workers of other hosts.

    ``job_users`` (``--job-account``) renders a system account for each of those fleet users,
    a folder only it opens, and what the workers need to run the user's jobs as it.

    Raises:
        ConfigError: incompatible options, a URL without a password to another host, a
            Sentinel layout that is not an odd number (3 or more) of distinct IP addresses with
            this host among them, or a job user whose name cannot make an account's.
    """
    if join_url is not None and serve_address is not None:
        raise ConfigError("--join and --serve exclude each other: a host either runs Redis or joins one")
    if sentinel_hosts is not None and (join_url is not None or serve_address is not None):
        raise ConfigError("--sentinel excludes --join and --serve: it renders the first host of a Sentinel "
                          "layout; the others join it with the printed --join ... --this-host command")
    if join_url is not None:
        try:
            check_redis_auth(join_url)
        except ValueError as exc:
            raise ConfigError(f"--join {join_url!r}: {exc}") from None
    sentinel = _sentinel_layout(sentinel_hosts, join_url, this_host)
    if gpus is None:
        from ..core.devices import count_gpus

        gpus = count_gpus()
    binary = devicefleet_bin or _find_bin("devicefleet")
    plan = HostPlan(
        devicefleet_bin=binary,
        python_bin=script_interpreter(binary),
        worker_configs_src=worker_configs_src or _default_worker_configs(),
        cpu_workers=cpu_workers,
        gpus=gpus,
        join_url=join_url,
        serve_address=serve_address,
        **paths,  # type: ignore[arg-type]
    )
    plan.code_dirs = code_dirs(binary)
    plan.job_users = tuple(dict.fromkeys(job_users))
    for name, account in plan.job_accounts.items():
        check_user(name)
        try:
            check_account_name(account)
        except ValueError as exc:
            raise ConfigError(f"--job-account {name}: {exc}") from None
    if sentinel is not None:
        hosts, plan.this_host = sentinel
        plan.sentinel_hosts = tuple(host for host, _ in hosts)
        if join_url is not None:
            url = SentinelURL.parse(join_url)
            plan.sentinel_port = dict(hosts).get(plan.this_host or "", plan.sentinel_port)
            plan.master_name = url.master_name
            plan.redis_password = url.password or ""
            plan.sentinel_password = url.sentinel_password or ""
    multi_host = join_url is not None or serve_address is not None or sentinel is not None
    plan.device_names = device_names or (DeviceNames.HOST if multi_host else DeviceNames.SHORT)
    _reuse_secrets(plan, root)
    return plan


def _sentinel_layout(sentinel_hosts: Sequence[str] | None, join_url: str | None,
                     this_host: str | None) -> tuple[list[tuple[str, int]], str | None] | None:
    """The layout's ``(address, sentinel port)`` pairs and this host's address, or None (no
    Sentinel layout, or a host that only joins one)."""
    joins_sentinel = join_url is not None and is_sentinel(join_url)
    if sentinel_hosts is None and not joins_sentinel:
        if this_host is not None:
            raise ConfigError(f"--this-host {this_host!r} needs --sentinel, or --join with a sentinel:// URL")
        return None
    if sentinel_hosts is not None:
        hosts = [(host.strip(), DEFAULT_SENTINEL_PORT) for host in sentinel_hosts]
        what = f"--sentinel {','.join(sentinel_hosts)!r}"
        if this_host is not None and hosts and this_host != hosts[0][0]:
            raise ConfigError(f"--this-host {this_host!r} with {what}: --sentinel renders the first host, "
                              f"{hosts[0][0]} (the initial primary); run on {this_host} the --join command it prints")
    else:
        assert join_url is not None
        if this_host is None:
            return [], None  # a host with workers only, which reaches the sentinels of others
        url = SentinelURL.parse(join_url)
        hosts = list(url.sentinels)
        what = f"the URL's sentinels ({', '.join(h for h, _ in hosts)})"
        if not (url.password and url.sentinel_password):
            raise ConfigError("--join with --this-host: the URL must carry the Redis password and "
                              "sentinel_password=, which this host's Redis and sentinel are given")
    addresses = [host for host, _ in hosts]
    for host in addresses:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{what}: {host!r} is not an IP address; sentinels and replicas "
                              "are configured by address here") from None
    twice = sorted({host for host in addresses if addresses.count(host) > 1})
    if twice:
        raise ConfigError(f"{what}: {', '.join(twice)} named twice")
    if len(addresses) < 3 or len(addresses) % 2 == 0:
        raise ConfigError(f"{what}: {len(addresses)} hosts; a Sentinel layout needs an odd number, 3 or more, "
                          "so that a majority of the sentinels can elect one to run a failover")
    this = this_host if this_host is not None else addresses[0]
    if this not in addresses:
        raise ConfigError(f"--this-host {this!r} is not among {what}")
    return hosts, this


def code_dirs(binary: Path) -> list[Path]:
    """The folders the units read code from: the environment ``binary`` belongs to and, when it
    is this interpreter's, the interpreter's installation and the devicefleet package (the
    checkout, for an editable install)."""
    dirs = {binary.parent.parent}
    if binary.parent == Path(sys.prefix) / "bin":
        dirs |= {Path(sys.base_prefix).resolve(), Path(sys.executable).resolve().parent.parent, PACKAGE_ROOT}
    return sorted(dirs)


#: pip's launcher for an interpreter path too long (or spaced) for a ``#!`` line: ``#!/bin/sh``,
#: then ``'''exec' "/path/to/python" "$0" "$@"`` (distlib's ScriptMaker).
_SH_EXEC = re.compile(r"""^'''exec' "?(.+?)"? "\$0" """)


def script_interpreter(script: Path) -> Path:
    """The Python a console script (``devicefleet``) runs under: the one its ``#!`` line names
    (pip writes its environment's interpreter there), else ``python3`` beside it."""
    try:
        with open(script, "rb") as handle:
            lines = handle.read(1024).decode(errors="replace").splitlines()
    except OSError:
        lines = []
    if lines and lines[0].startswith("#!"):
        words = lines[0][2:].split()
        if words and Path(words[0]).name.startswith("python"):
            return Path(words[0])
        match = _SH_EXEC.match(lines[1]) if len(lines) > 1 else None
        if match:
            return Path(match[1])
    return script.parent / "python3"


def _find_bin(name: str) -> Path:
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ConfigError(f"no {name} executable next to {sys.executable} or on PATH; pass --bin")


def _default_worker_configs() -> Path:
    from ..core.settings import Settings

    return Settings.load().worker_configs_path


def _under(root: Path, path: Path) -> Path:
    return root / path.relative_to(path.anchor) if path.is_absolute() else root / path


def _reuse_secrets(plan: HostPlan, root: Path) -> None:
    # A host that joins takes its passwords from the URL; the one that made them reads them back.
    made_here = plan.join_url is None
    for name, attr in (("devicefleet.conf", "redis_password"), (SENTINEL_FILE, "sentinel_password")):
        conf = _under(root, plan.redis_conf_dir / name)
        if made_here and plan.runs_redis and conf.is_file():
            for line in conf.read_text().splitlines():
                if line.startswith("requirepass "):
                    setattr(plan, attr, line.split(None, 1)[1].strip())
    flower = _under(root, plan.config_dir / "flower.env")
    if flower.is_file():
        match = re.search(r'^FLOWER_BASIC_AUTH="([^"]+)"', flower.read_text(), re.MULTILINE)
        if match:
            plan.flower_auth = match[1]


def stop_timeout(configs_dir: Path, device: Device, margin_s: int) -> tuple[int, Path, int, int]:
    """``(TimeoutStopSec, config file, the worker's own stop timeout, its cancel grace)`` of
    ``device``'s worker.

    A stopping worker gives its running job its ``stop_timeout_s`` (default ``max_job_seconds``),
    then ``cancel_grace_s`` to stop at ``ctx.progress()`` before it ends the job's process group
    and stores its entry; systemd waits that long, plus the margin, before its SIGKILL.
    """
    config = load_worker_config(configs_dir, device)
    worker_stop = config.stop_timeout_s or config.max_job_seconds
    grace = math.ceil(config.cancel_grace_s)
    return worker_stop + grace + margin_s, config_file(configs_dir, device), worker_stop, grace


@dataclass(frozen=True)
class CommandPaths:
    """What a worker unit must open for the commands its config allows (``[commands]``): the
    sandbox hides homes and the host's /tmp, and leaves the rest read-only."""

    #: Workdirs the unit shows read-only (``ReadWritePaths=``).
    read_write: tuple[Path, ...]
    #: Workdirs under a folder the unit hides, bound back in read-write (``BindPaths=``).
    binds: tuple[Path, ...]
    #: Environments of absolute programs under a hidden folder (``BindReadOnlyPaths=``).
    read_only_binds: tuple[Path, ...]

    @property
    def protect_home_tmpfs(self) -> bool:
        """Whether a bind is under a home folder: ``ProtectHome=yes`` would mask it."""
        return any(d.is_relative_to(r) for d in (*self.binds, *self.read_only_binds) for r in HOME_ROOTS)

    def lines(self) -> list[str]:
        """The ``[Service]`` lines; never an empty assignment (in a drop-in it would reset the
        unit's own list, its code binds included)."""
        out = [f"ReadWritePaths=-{d}" for d in self.read_write]
        out += [f"BindPaths=-{d}" for d in self.binds]
        if self.protect_home_tmpfs:
            out.append("ProtectHome=tmpfs")
        out += [f"BindReadOnlyPaths=-{d}" for d in self.read_only_binds]
        return out


def command_paths(policy: CommandPolicy, bound_code: Iterable[Path] = ()) -> CommandPaths | None:
    """The folders a worker unit must open for ``policy``; None when it allows no command.

    Paths are resolved as the worker resolves its workdirs (symlinks followed). ``bound_code``
    (the unit's own read-only code binds) are not bound again.

    Raises:
        ConfigError: a path holds a character systemd would split or expand.
    """
    if not policy.enabled:
        return None
    if policy.home_workdirs():
        raise ConfigError(f"commands.workdirs {policy.home_workdirs()[0]!r}: under systemd a worker's home is the "
                          "service's, not yours; give the folder's absolute path in the worker config's [commands]")
    bound = set(bound_code)
    read_write: list[Path] = []
    binds: list[Path] = []
    for folder in dict.fromkeys(Path(os.path.realpath(d)) for d in policy.workdirs):
        _check_safe("commands.workdirs folder", str(folder))
        (binds if _hidden(folder) else read_write).append(folder)
    envs: list[Path] = []
    for program in policy.programs:
        if not os.path.isabs(program):
            continue  # found on the unit's PATH, which the sandbox shows
        for path in dict.fromkeys((Path(program), Path(os.path.realpath(program)))):
            env = path.parent.parent if path.parent.name == "bin" else path.parent
            if _hidden(env) and not any(env.is_relative_to(d) for d in (*bound, *envs)):
                envs.append(Path(_check_safe("commands.programs folder", str(env))))
    outermost = [d for d in envs if not any(d != o and d.is_relative_to(o) for o in envs)]
    return CommandPaths(tuple(read_write), tuple(binds), tuple(sorted(outermost)))


def _hidden(path: Path) -> bool:
    return any(path.is_relative_to(r) for r in HIDDEN_ROOTS)


def render(plan: HostPlan, root: Path = Path("/")) -> Rendered:
    """Write every file of ``plan`` under ``root``; return them and the commands to run.

    Raises:
        ConfigError: a worker config is invalid, or a value cannot go into a unit file.
    """
    src = templates_dir()
    written: list[Path] = []
    kept: list[Path] = []

    def write(target: Path, text: str, mode: int = 0o644) -> None:
        path = _under(root, target)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=mode, exist_ok=True)
        path.chmod(mode)  # before the content: a secret is never world-readable
        path.write_text(text)
        written.append(target)

    # Worker configs first: the units' timeouts come from the copy the units will read.
    configs = plan.config_dir / "worker_configs"
    for source in sorted(plan.worker_configs_src.glob("*.toml")):
        target = configs / source.name
        if _under(root, target).exists():
            kept.append(target)
        else:
            write(target, source.read_text())
    configs_here = _under(root, configs)
    for device in plan.devices:  # validate every file now, not in a worker's journal
        load_worker_config(configs_here, Device.parse(device))

    after = " ".join(plan.local_units)
    workers = [f"devicefleet-worker@{d}.service" for d in plan.devices]
    groups = [f"devicefleet-worker@{d}.socket" for d in plan.gpu_devices] + [GROUP_UNIT] if plan.runs_groups else []
    wanted = plan.local_units + workers + groups + [FLOWER_UNIT, METRICS_UNIT]
    margin = plan.stop_margin_s
    timeouts = {d: stop_timeout(configs_here, Device.parse(d), margin) for d in plan.devices}
    binds = plan.hidden_code_dirs
    values: dict[str, object] = {
        "after_units": after,
        # ProtectHome=yes makes /root and /home unreadable; tmpfs hides them too but lets the
        # code folders below be bound back in (a venv under /root otherwise fails with 203/EXEC).
        "protect_home": "tmpfs" if any(d.is_relative_to(r) for d in binds for r in HOME_ROOTS) else "yes",
        "code_binds": " ".join(_check_safe("code folder", str(d)) for d in binds),
        "user": _check_safe("user", plan.user),
        "config_dir": _check_safe("config dir", str(plan.config_dir)),
        "state_dir": _check_safe("state dir", str(plan.state_dir)),
        "group_socket_dir": _check_safe("group socket dir", str(plan.group_socket_dir)),
        "artifacts_dir": _check_safe("artifacts dir", str(plan.artifacts)),
        "devicefleet_bin": _check_safe("devicefleet binary", str(plan.devicefleet_bin)),
        "python_bin": _check_safe("Python binary", str(plan.python_bin)),
        "timeout_stop_s": max([t for t, _, _, _ in timeouts.values()],
                              default=MAX_JOB_SECONDS + math.ceil(CANCEL_GRACE_S) + margin),
        "flower_address": plan.flower_address,
        "flower_port": plan.flower_port,
        "metrics_port": plan.metrics_port,
        "flower_auth": _check_safe("Flower login", plan.flower_auth),
        "worker_list": ", ".join(plan.devices) or "none",
        "wanted_units": " ".join(wanted),
        "redis_url": _check_url(plan.redis_url),
        "cpu_workers": plan.cpu_workers,
        "gpus": plan.gpus,
        "device_names": plan.device_names.value,
        "device_host": _check_safe("device host", plan.device_host),
        # Job accounts traverse the state and artifacts folders to their own (0751: no listing).
        "shared_mode": "0751" if plan.job_users else "0750",
        "job_account_users": "".join(
            f'u       {account}  -   "devicefleet jobs of {name}"  {user_folder(plan.artifacts, name)}\n'
            for name, account in plan.job_accounts.items()),
        "job_account_folders": "".join(
            ([f"d       {plan.artifacts / USERS_SUBDIR}  0751  {plan.user}  {plan.user}  -\n"] if plan.job_users else [])
            + [f"d       {user_folder(plan.artifacts, name)}  0700  {account}  {account}  -\n"
               for name, account in plan.job_accounts.items()]),
    }

    def template(name: str, extra: dict[str, object] | None = None) -> str:
        return fill((src / name).read_text(), values | (extra or {}))

    units = plan.unit_dir
    write(units / WORKER_UNIT, template(WORKER_UNIT))
    for device in plan.devices:
        timeout, cfg, worker_stop, grace = timeouts[device]
        dropins = units / f"devicefleet-worker@{device}.service.d"
        write(dropins / "10-stop-timeout.conf", template("worker-stop-timeout.conf", {
            "device": device, "timeout_stop_s": timeout, "margin_s": margin,
            "worker_stop_s": worker_stop, "cancel_grace_s": grace,
            "config_file": plan.config_dir / "worker_configs" / cfg.name,
        }))
        parsed = Device.parse(device)
        if parsed.kind is DeviceKind.GPU:
            write(dropins / "20-gpu.conf", template("worker-gpu.conf", {
                "device": device, "gpu_index": parsed.index,
            }))
            if plan.runs_groups:
                write(dropins / "25-groups.conf", template("worker-groups.conf", {"device": device}))
        if plan.job_users:
            write(dropins / "40-job-accounts.conf", template("worker-job-accounts.conf", {
                "device": device,
                "job_accounts": ",".join(f"{name}={account}" for name, account in plan.job_accounts.items()),
                "capabilities": " ".join(WORKER_CAPABILITIES),
            }))
        policy = load_worker_config(configs_here, parsed).commands
        opened = command_paths(policy, binds)
        if opened is not None:
            write(dropins / "30-commands.conf", template("worker-commands.conf", {
                "device": device, "config_file": plan.config_dir / "worker_configs" / cfg.name,
                # JSON, as in the TOML file: a newline in a name cannot end the comment line.
                "programs": json.dumps(policy.programs), "workdirs": json.dumps(policy.workdirs),
                "command_paths": "\n".join(opened.lines()),
            }))
    if plan.runs_groups:
        write(units / GROUP_SOCKET_UNIT, template(GROUP_SOCKET_UNIT))
        write(units / GROUP_UNIT, template(GROUP_UNIT, {
            "sandbox": worker_sandbox(template(WORKER_UNIT)),
            "gpu_device_allow": "\n".join(f"DeviceAllow=/dev/nvidia{i} rw" for i in range(plan.gpus)),
            "leader_sockets": " ".join(str(plan.group_socket_dir / f"{d}.sock") for d in plan.gpu_devices),
        }))
    write(units / FLOWER_UNIT, template(FLOWER_UNIT))
    write(units / METRICS_UNIT, template(METRICS_UNIT))
    write(units / TARGET_UNIT, template(TARGET_UNIT))
    write(plan.sysusers_file, template("devicefleet.sysusers"))
    write(plan.tmpfiles_file, template("devicefleet.tmpfiles"))
    write(plan.config_dir / "devicefleet.env", template("devicefleet.env"), 0o640)
    write(plan.config_dir / "flower.env", template("flower.env"), 0o640)
    if plan.runs_sentinel:
        _render_sentinel_host(plan, template, write)
    elif plan.runs_redis:
        redis_values = {
            "redis_bind": _bind_addresses(plan.serve_address),
            "redis_port": plan.redis_port if plan.serve_address is None else 0,
            "redis_password": plan.redis_password,
            "redis_tls_port": plan.redis_tls_port,
            "redis_tls_host": plan.serve_address,
        }
        text = template("redis-devicefleet.conf", redis_values)
        if plan.serve_address is not None:
            text += template("redis-devicefleet-tls.conf", redis_values)
        write(plan.redis_conf_dir / "devicefleet.conf", text, 0o640)
    return Rendered(written, kept, commands(plan, root), [TARGET_UNIT, *workers, *groups, FLOWER_UNIT, METRICS_UNIT])


def worker_sandbox(worker_unit: str) -> str:
    """The hardening lines of a rendered worker unit, for the group unit: one sandbox for every
    process that runs jobs, without the worker's ``PrivateDevices=yes`` (the group unit opens
    its GPUs' nodes).

    Raises:
        ConfigError: the worker template has no ``# Hardening:`` block before ``[Install]``.
    """
    start, end = worker_unit.find(SANDBOX_START), worker_unit.find("[Install]")
    if start < 0 or end < start:
        raise ConfigError(f"{WORKER_UNIT}: no '{SANDBOX_START}' block before [Install] to copy into {GROUP_UNIT}")
    lines = worker_unit[start:end].rstrip().splitlines()
    out: list[str] = []
    for line in lines:
        if line.startswith("PrivateDevices="):
            while out and out[-1].startswith("#"):  # its comment goes with it
                out.pop()
            continue
        out.append(line)
    return "\n".join(out)


def _render_sentinel_host(plan: HostPlan, template: Callable[[str, dict[str, object]], str],
                          write: Callable[[Path, str, int], None]) -> None:
    """This host's Redis (a primary or replica) and sentinel, and the drop-ins of their units."""
    assert plan.this_host is not None
    hosts = plan.sentinel_hosts
    values: dict[str, object] = {
        "this_host": plan.this_host,
        "hosts": ", ".join(hosts),
        "host_count": len(hosts),
        "primary": plan.primary,
        "role": "the initial primary" if plan.this_host == plan.primary else f"a replica of {plan.primary} at first",
        "redis_port": plan.redis_port,
        "redis_password": _check_safe("Redis password", plan.redis_password),
        "sentinel_port": plan.sentinel_port,
        "sentinel_password": _check_safe("sentinels' password", plan.sentinel_password),
        "master_name": _check_safe("master_name", plan.master_name),
        # A majority: enough sentinels to call the primary down, and to elect one to fail over.
        "quorum": len(hosts) // 2 + 1,
        "down_after_ms": SENTINEL_DOWN_AFTER_MS,
        "failover_timeout_ms": SENTINEL_FAILOVER_TIMEOUT_MS,
    }
    conf = plan.redis_conf_dir
    write(conf / "devicefleet.conf", template("redis-devicefleet-replicated.conf", values), 0o640)
    write(conf / SENTINEL_FILE, template("redis-sentinel-devicefleet.conf", values), 0o640)
    for unit in (REDIS_UNIT, SENTINEL_UNIT):
        write(plan.unit_dir / f"{unit}.d" / "devicefleet.conf",
              template("redis-network-online.conf", values | {"unit": unit}), 0o644)


def redis_conf_lines(plan: HostPlan) -> list[str]:
    """The lines the printed commands add to Debian's ``/etc/redis/redis.conf`` (once): the
    include of devicefleet's snippet, and on a replica of a Sentinel layout ``replicaof``, which
    must be in that file itself because Sentinel's ``CONFIG REWRITE`` rewrites it there."""
    lines = [f"include {plan.redis_conf_dir / 'devicefleet.conf'}"]
    if plan.runs_sentinel and plan.this_host != plan.primary:
        lines.append(f"replicaof {plan.primary} {plan.redis_port}")
    return lines


def join_commands(plan: HostPlan) -> dict[str, str]:
    """For the first host of a Sentinel layout: the command each other host runs, by address.
    It carries the URL, with both passwords."""
    if not plan.runs_sentinel or plan.join_url is not None:
        return {}
    return {host: f"devicefleet deploy --join '{plan.redis_url}' --this-host {host}"
            for host in plan.sentinel_hosts if host != plan.this_host}


def _bind_addresses(serve_address: str | None) -> str:
    """Loopback always, plus the address other hosts reach (once: Redis fails on a duplicate)."""
    addresses = ["127.0.0.1", "-::1"]
    if serve_address is not None and serve_address not in ("127.0.0.1", "::1", "localhost"):
        addresses.append(serve_address)
    return " ".join(addresses)


def _check_url(url: str) -> str:
    # %XX escapes are fine in an EnvironmentFile value; $, quotes and spaces are not.
    if re.search(r"[\s\"'\\$`]", url):
        raise ConfigError(
            "the Redis URL contains a space, quote, backslash, $ or `, which systemd would "
            "expand or split; percent-encode the password"
        )
    return url


def commands(plan: HostPlan, root: Path = Path("/")) -> list[str]:
    """The shell commands, as root, that finish the installation on the host."""
    user = plan.user
    out: list[str] = []
    if root != Path("/"):
        out.append(f"cp -a --no-preserve=ownership {root}/. /   # install the reviewed files")
    out += [
        f"systemd-sysusers {plan.sysusers_file}   # the {user} system user",
        f"systemd-tmpfiles --create {plan.tmpfiles_file}   # its state and artifacts folders",
        f"chown root:{user} {plan.config_dir}/devicefleet.env {plan.config_dir}/flower.env",
    ]
    if plan.runs_sentinel:
        out += _sentinel_commands(plan)
    elif plan.runs_redis:
        conf = plan.redis_conf_dir / "devicefleet.conf"
        include = f"include {conf}"
        out += [
            "apt-get install -y redis-server",
            f"chown root:redis {conf}",
            f"grep -qxF '{include}' /etc/redis/redis.conf || echo '{include}' >> /etc/redis/redis.conf",
        ]
        if plan.serve_address is not None:
            out.append(
                f"ls /etc/redis/tls/redis.crt /etc/redis/tls/redis.key /etc/redis/tls/ca.crt "
                f"{plan.config_dir}/tls/ca.crt   # TLS files: see the README"
            )
        out.append("systemctl restart redis-server")
    elif plan.join_url and "ssl_ca_certs=" in plan.join_url:
        out.append(f"ls {plan.config_dir}/tls/ca.crt   # the fleet's CA certificate, from the Redis host")
    if "systemctl daemon-reload" not in out:  # the Sentinel commands reload before their restart
        out.append("systemctl daemon-reload")
    if plan.runs_sentinel and plan.join_url is None:
        # The first host: its Redis refuses writes until a replica has them (min-replicas-to-write
        # 1); a worker whose registration is refused (NOREPLICAS) exits 1 and systemd starts it
        # again and again until then: start them once a replica follows.
        out += [f"systemctl enable {TARGET_UNIT}",
                f"systemctl start {TARGET_UNIT}   # once another host's Redis replicates this one"]
    else:
        out.append(f"systemctl enable --now {TARGET_UNIT}")
    out.append(f"(set -a; . {plan.config_dir}/devicefleet.env; {plan.devicefleet_bin} status)"
               "   # the fleet, as the workers see it")
    return out


def _sentinel_commands(plan: HostPlan) -> list[str]:
    conf = plan.redis_conf_dir
    include, *replicaof = redis_conf_lines(plan)
    first = [f"install -o redis -g redis -m 0640 {conf / SENTINEL_FILE} {conf}/sentinel.conf"]
    first += [f"echo '{line}' >> {conf}/redis.conf" for line in replicaof]
    monitor = f"sentinel monitor {plan.master_name} "
    return [
        "apt-get install -y redis-server redis-sentinel",
        f"chown root:redis {conf / 'devicefleet.conf'} {conf / SENTINEL_FILE}",
        f"grep -qxF '{include}' {conf}/redis.conf || echo '{include}' >> {conf}/redis.conf",
        # Once only: from then on the sentinel rewrites its file, and Sentinel's CONFIG REWRITE
        # the replicaof line (which on a promoted replica is gone, and must stay gone).
        f"grep -q '^{monitor}' {conf}/sentinel.conf || ({' && '.join(first)})"
        "   # first install only: the sentinel owns these lines from then on",
        "systemctl daemon-reload",
        f"systemctl restart {REDIS_UNIT} {SENTINEL_UNIT}",
    ]


def read_env_value(text: str, name: str) -> str | None:
    """The value of ``name`` in an EnvironmentFile we rendered (double-quoted, no escapes)."""
    match = re.search(rf'^{re.escape(name)}="([^"]*)"', text, re.MULTILINE)
    return match[1] if match else None


__all__ = [
    "CommandPaths",
    "HostPlan",
    "Rendered",
    "command_paths",
    "commands",
    "fill",
    "join_commands",
    "plan_host",
    "read_env_value",
    "redis_conf_lines",
    "render",
    "script_interpreter",
    "stop_timeout",
    "templates_dir",
    "worker_sandbox",
]
