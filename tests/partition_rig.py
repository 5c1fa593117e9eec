"""A network partition rig on real processes: Redis and device workers on network namespaces.

Layout (a star, Redis in the middle)::

    dfp-<tag>-redis   redis-server, bound to 10.213.<i>.1 (one veth per host) and a unix socket
        |  veth 10.213.1.1 <-> 10.213.1.2
    dfp-<tag>-hosta   ``python -m tasks worker cpu0`` as device ``cpu0@hosta``
        |  veth 10.213.2.1 <-> 10.213.2.2
    dfp-<tag>-hostb   ``python -m tasks worker cpu0`` as device ``cpu0@hostb``

The producer (the test process) stays in its own namespace and reaches Redis through a unix
socket (namespaces share the filesystem) that a small forwarder serves on 127.0.0.1: no address
is added outside the namespaces the rig made. A cut of a host is a ``pfifo limit 0`` qdisc on
both ends of its veth, which drops every packet silently, as a dead switch port does (this kernel
has no netem); the heal removes both. Every namespace (and with it every veth), process and
folder the rig made is removed on the way out, also when the test fails.

Needs root, ``ip`` and ``tc`` (iproute2): elsewhere the tests skip naming what is missing
(:mod:`tests.system_tools`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tasks.core.registry import live_workers
from tasks.ops.redis_server import find_redis_server

from . import system_tools
from .conftest import TEST_JOB_MODULES, cli_env, wait_for

#: The private range the rig's links use, only ever inside the namespaces it made.
SUBNET = "10.213"
REDIS_PORT = 6379
#: The worker settings the issue's rig used (tasks/core/settings.py names them): a cut-off
#: worker's job is given back after max(lease, heartbeat TTL) + reaper interval.
LEASE_TTL_S = 4.0
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5.0
REAPER_INTERVAL_S = 0.5
#: When a cut-off host's job may run again elsewhere at the earliest (both its lease and its
#: worker's registry record must have expired, then a reaper round).
RECOVERY_BOUND_S = max(LEASE_TTL_S, HEARTBEAT_TTL_S) + REAPER_INTERVAL_S
JOB_MODULES = [*TEST_JOB_MODULES, "tests.partition_jobs"]
#: How long a worker may take to join (imports torch on a loaded 2-core host).
JOIN_TIMEOUT_S = 90.0
#: How long a process the rig stops has after SIGTERM before SIGKILL: a worker's warm shutdown
#: takes seconds the teardown has no use for (nothing it would save outlives the rig).
STOP_TIMEOUT_S = 2.0
#: Bound on any one ``ip``/``tc`` call.
TOOL_TIMEOUT_S = 10.0


def require_tools() -> tuple[str, str]:
    """``(ip, tc)``: skip (or fail under CI) when this is not root or iproute2 is missing."""
    system_tools.root("the partition rig (network namespaces, veth links, qdiscs)")
    return system_tools.tool("ip", "iproute2"), system_tools.tool("tc", "iproute2")


def run_tool(argv: list[str]) -> None:
    """Run ``ip``/``tc`` (bounded in time); RuntimeError with its stderr if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")


class UnixForwarder:
    """Serves 127.0.0.1:<port> by copying bytes to and from a unix socket: the producer's way to
    the Redis in another network namespace, with no address outside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="rig-forwarder", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(str(self.path))
            except OSError:
                client.close()
                upstream.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):  # one side gone: end both, as a TCP peer's close would
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            opened, self._open = self._open, set()
        self._listener.close()
        for sock in opened:
            sock.close()


@dataclass
class Host:
    """One host of the rig: its namespace, its veth (host end, Redis end) and its worker."""

    name: str
    index: int
    netns: str
    veth: str
    peer: str
    device: str
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}.2"

    @property
    def redis_address(self) -> str:
        return f"{SUBNET}.{self.index}.1"


@dataclass
class PartitionRig:
    """Redis and one CPU worker per host, each in its own network namespace (see the module)."""

    ip: str
    tc: str
    folder: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    hosts: dict[str, Host] = field(default_factory=dict)
    redis_process: subprocess.Popen[bytes] | None = None
    forwarder: UnixForwarder | None = None
    _namespaces: list[str] = field(default_factory=list)

    @property
    def redis_netns(self) -> str:
        return f"dfp-{self.tag}-redis"

    @property
    def socket_path(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def producer_url(self) -> str:
        """The URL the test process (the producer) reaches Redis at: never cut."""
        assert self.forwarder is not None
        return f"redis://:{self.password}@127.0.0.1:{self.forwarder.port}/0"

    def worker_url(self, host: Host) -> str:
        return f"redis://:{self.password}@{host.redis_address}:{REDIS_PORT}/0"

    def client(self) -> redis.Redis:
        """A client of the rig's Redis for the test (``str`` replies, never cut)."""
        return redis.Redis.from_url(self.producer_url, decode_responses=True, socket_timeout=10)

    # -- building and removing -------------------------------------------------------------

    def _netns(self, name: str) -> str:
        run_tool([self.ip, "netns", "add", name])
        self._namespaces.append(name)
        run_tool([self.ip, "-n", name, "link", "set", "lo", "up"])
        return name

    def _router(self, netns: str) -> None:
        """``netns`` forwards between the hosts' links (its own sysctl: nothing outside it changes)."""
        run_tool([self.ip, "netns", "exec", netns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        # veth names are at most 15 characters: dfh<tag><i> / dfr<tag><i>.
        host = Host(name=name, index=index, netns=self._netns(f"dfp-{self.tag}-{name}"),
                    veth=f"dfh{self.tag}{index}", peer=f"dfr{self.tag}{index}",
                    device=f"cpu0@{name}", log=self.folder / f"{name}.log")
        run_tool([self.ip, "link", "add", host.veth, "netns", host.netns, "type", "veth",
              "peer", "name", host.peer, "netns", self.redis_netns])
        for netns, dev, address in ((host.netns, host.veth, host.address),
                                    (self.redis_netns, host.peer, host.redis_address)):
            run_tool([self.ip, "-n", netns, "addr", "add", f"{address}/24", "dev", dev])
            run_tool([self.ip, "-n", netns, "link", "set", dev, "up"])
        # The hosts reach each other through Redis's namespace (a distributed job's ranks talk
        # directly), so a cut host is cut off from its peers too.
        run_tool([self.ip, "-n", host.netns, "route", "add", f"{SUBNET}.0.0/16", "via", host.redis_address])
        self.hosts[name] = host
        return host

    def start_redis(self) -> None:
        conf = self.folder / "redis.conf"
        conf.touch(mode=0o600)
        binds = " ".join(["127.0.0.1", *(h.redis_address for h in self.hosts.values())])
        conf.write_text("\n".join([
            f"bind {binds}",
            f"port {REDIS_PORT}",
            f"unixsocket {self.socket_path}",
            "unixsocketperm 700",
            f"requirepass {self.password}",
            f"dir {self.folder}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"logfile {self.folder / 'redis.log'}",
        ]) + "\n")
        binary = find_redis_server()
        self.redis_process = subprocess.Popen([self.ip, "netns", "exec", self.redis_netns, str(binary), str(conf)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.socket_path.exists, 20, "the rig's redis-server socket", proc=self.redis_process)
        self.forwarder = UnixForwarder(self.socket_path)
        with self.client() as client:
            wait_for(client.ping, 20, "the rig's redis-server to answer PING", proc=self.redis_process)

    def start_worker(self, host: Host, cores: str) -> None:
        """``devicefleet worker cpu0`` in ``host``'s namespace, started as a user starts one."""
        env = cli_env(
            DEVICEFLEET_REDIS_URL=self.worker_url(host),
            DEVICEFLEET_DEVICE_NAMES="host",
            DEVICEFLEET_DEVICE_HOST=host.name,
            DEVICEFLEET_CORES=cores,
            DEVICEFLEET_STATE_DIR=str(self.folder / f"state-{host.name}"),
            DEVICEFLEET_JOB_MODULES=",".join(JOB_MODULES),
            DEVICEFLEET_LEASE_TTL_S=str(LEASE_TTL_S),
            DEVICEFLEET_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_INTERVAL_S),
            DEVICEFLEET_HEARTBEAT_TTL_S=str(HEARTBEAT_TTL_S),
            DEVICEFLEET_REAPER_INTERVAL_S=str(REAPER_INTERVAL_S),
            # gloo finds its address from the host name, which names no address in the namespace.
            GLOO_SOCKET_IFNAME=host.veth,
        )
        with host.log.open("w") as log:
            host.process = subprocess.Popen(
                [self.ip, "netns", "exec", host.netns, sys.executable, "-m", "tasks", "worker", "cpu0"],
                env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_joined(self) -> None:
        with self.client() as client:
            for host in self.hosts.values():
                def joined(device: str = host.device) -> bool:
                    record = live_workers(client).get(device)
                    return record is not None and record.ready

                wait_for(joined, JOIN_TIMEOUT_S, f"{host.device} to join", proc=host.process)

    def close(self) -> None:
        """Remove everything the rig made: processes, namespaces (their veths go with them)."""
        stop_process(*(host.process for host in self.hosts.values()))
        if self.forwarder is not None:
            self.forwarder.close()
        stop_process(self.redis_process)
        for netns in reversed(self._namespaces):
            # Anything still running in a namespace the rig made is the rig's (a job process).
            pids = subprocess.run([self.ip, "netns", "pids", netns], capture_output=True, text=True,
                                  timeout=TOOL_TIMEOUT_S).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run([self.ip, "netns", "del", netns], capture_output=True, timeout=TOOL_TIMEOUT_S)
        self._namespaces.clear()

    # -- partitions --------------------------------------------------------------------------

    def _ends(self, host: Host) -> list[tuple[str, str]]:
        return [(host.netns, host.veth), (self.redis_netns, host.peer)]

    def cut(self, name: str) -> float:
        """Drop every packet between host ``name`` and Redis, both ways; the wall time of the cut."""
        host = self.hosts[name]
        for netns, dev in self._ends(host):
            run_tool([self.ip, "netns", "exec", netns, self.tc, "qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0"])
        return time.time()

    def heal(self, name: str) -> float:
        """Undo :meth:`cut`; the wall time of the heal."""
        host = self.hosts[name]
        for netns, dev in self._ends(host):
            run_tool([self.ip, "netns", "exec", netns, self.tc, "qdisc", "del", "dev", dev, "root"])
        return time.time()

    @contextmanager
    def partitioned(self, name: str) -> Iterator[float]:
        """Host ``name`` cut off inside the block (healed on the way out, also on failure)."""
        at = self.cut(name)
        try:
            yield at
        finally:
            self.heal(name)

    @contextmanager
    def paused(self, name: str) -> Iterator[float]:
        """Host ``name``'s worker process stopped (SIGSTOP: a pause, as a long GC or a frozen VM
        makes one) inside the block, its job processes left running; SIGCONT on the way out."""
        process = self.hosts[name].process
        assert process is not None and process.poll() is None, f"{name}'s worker is not running"
        os.kill(process.pid, signal.SIGSTOP)
        try:
            yield time.time()
        finally:
            os.kill(process.pid, signal.SIGCONT)

    def reaches_redis(self, name: str, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from host ``name``'s namespace to Redis opens in ``timeout``."""
        host = self.hosts[name]
        probe = (f"import socket; socket.create_connection(({host.redis_address!r}, {REDIS_PORT}), "
                 f"timeout={timeout}).close()")
        done = subprocess.run([self.ip, "netns", "exec", host.netns, sys.executable, "-c", probe],
                              capture_output=True, timeout=timeout + TOOL_TIMEOUT_S)
        return done.returncode == 0

    def log_tail(self, name: str, lines: int = 30) -> str:
        text = self.hosts[name].log.read_text(errors="replace") if self.hosts[name].log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def stop_process(*processes: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to each at once, then SIGKILL to those still running after :data:`STOP_TIMEOUT_S`."""
    running = [p for p in processes if p is not None and p.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(TOOL_TIMEOUT_S)


@contextmanager
def partition_rig(hosts: tuple[str, ...] = ("hosta", "hostb"), workers: bool = True) -> Iterator[PartitionRig]:
    """A started rig (Redis, one worker per host, all joined; no worker unless ``workers``);
    removed on the way out."""
    ip, tc = require_tools()
    with ExitStack() as stack:
        folder = Path(tempfile.mkdtemp(prefix="dfp-"))  # short: a unix socket path has 108 bytes
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        rig = PartitionRig(ip=ip, tc=tc, folder=folder)
        stack.callback(rig.close)
        try:
            rig._netns(rig.redis_netns)
            rig._router(rig.redis_netns)
        except RuntimeError as exc:  # root in a container without CAP_SYS_ADMIN / CAP_NET_ADMIN
            system_tools.unavailable(f"network namespaces: {exc}")
        for name in hosts:
            rig.add_host(name)
        rig.start_redis()
        if workers:
            cpus = sorted(os.sched_getaffinity(0))
            for i, host in enumerate(rig.hosts.values()):
                rig.start_worker(host, str(cpus[i % len(cpus)]))
            rig.wait_joined()
        yield rig


# -- the ticks of tests/partition_jobs.py -----------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One run of a job, from its ticks: where, its token, which process, first and last tick."""

    device: str
    run: str
    pid: int
    first: float
    last: float


def runs(marker: Path, job_id: str) -> list[Run]:
    """The runs of ``job_id`` that ticked into ``marker`` (``tick`` jobs), oldest first."""
    path = marker / job_id
    if not path.exists():
        return []
    seen: dict[tuple[str, str, int], list[float]] = {}
    for line in path.read_text().splitlines():
        try:
            tick: dict[str, Any] = json.loads(line)
        except ValueError:  # a line cut short by a run killed mid-write
            continue
        seen.setdefault((tick["device"], tick["run"], tick["pid"]), []).append(tick["t"])
    found = [Run(device, run, pid, min(ts), max(ts)) for (device, run, pid), ts in seen.items()]
    return sorted(found, key=lambda r: r.first)


def overlap_s(found: list[Run]) -> float:
    """The longest time two runs on different devices were both ticking."""
    worst = 0.0
    for i, a in enumerate(found):
        for b in found[i + 1:]:
            if a.device != b.device:
                worst = max(worst, min(a.last, b.last) - max(a.first, b.first))
    return worst


# -- the two scenarios, measured --------------------------------------------------------


@dataclass
class CutFigures:
    """What a cut of the host running a long trial did (the issue's first experiment)."""

    #: ``cut`` (the host's link) or ``pause`` (its worker process stopped).
    fault: str
    job_id: str
    #: The device cut off with the trial running, and the other one.
    cut_device: str
    other_device: str
    #: Every run of the trial, oldest first; the last to start is the one that held the lease.
    runs: list[Run]
    #: The longest time two runs of the trial ticked at once on the two hosts.
    overlap_s: float
    #: From the cut to the trial's first tick on the other host (None: it never ran there).
    rerun_after_cut_s: float | None
    #: From the heal to the first tick of a job sent to the cut host's device.
    back_after_heal_s: float
    #: When the cut was healed (or the worker resumed).
    healed_at: float
    #: The trial's entry as the producer got it.
    entry: dict[str, Any]
    #: The deaths counted against the trial (``keys.worker_deaths``).
    deaths: list[str]
    #: Every trial's entry status.
    statuses: list[str]

    @property
    def cut_run_ended_after_heal_s(self) -> float:
        """The cut-off host's run's last tick, from the heal (negative: it ended before)."""
        return max(r.last for r in self.runs if r.device == self.cut_device) - self.healed_at

    @property
    def entry_run(self) -> Run | None:
        """The run whose output the entry carries."""
        output = self.entry.get("output") or {}
        return next((r for r in self.runs if r.run == output.get("run")), None)

    @property
    def healed(self) -> str:
        return "resume" if self.fault == "pause" else "heal"

    def report(self) -> str:
        held = self.runs[-1] if self.runs else None
        won = self.entry_run
        return (f"\nPARTITION long trial {self.fault} on {self.cut_device}: runs "
                f"{[(r.device, r.pid, round(r.last - r.first, 2)) for r in self.runs]}; "
                f"two runs alive at once {self.overlap_s:.2f} s; running again elsewhere "
                f"{_s(self.rerun_after_cut_s)} after the {self.fault} (bound {RECOVERY_BOUND_S:g} s + 1 s); "
                f"its run there ended {self.cut_run_ended_after_heal_s:.2f} s after the {self.healed}; "
                f"that host running a job {self.back_after_heal_s:.2f} s after the {self.healed}; the entry is the run "
                f"on {won.device if won else '?'} pid {won.pid if won else '?'} "
                f"({'the lease-holding' if won is not None and won == held else 'NOT the lease-holding'} "
                f"attempt); deaths counted {len(self.deaths)} {self.deaths}")


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def poll_until(check: Any, deadline: float, poll: float = 0.05) -> Any:
    """``check()``'s first truthy value before wall time ``deadline``, else its last value."""
    while not (last := check()) and time.time() < deadline:
        time.sleep(poll)
    return last


def wait_idle(rig: PartitionRig, timeout: float = 60.0) -> None:
    """Until no job holds a lease: every run of the last test has ended (or been given up)."""
    from tasks.core import keys

    with rig.client() as client:
        wait_for(lambda: client.hlen(keys.LEASES) == 0, timeout, "every lease to be released")


def back_after_heal(rig: PartitionRig, app: Any, name: str, healed_at: float, marker: Path,
                    timeout: float = 60.0) -> float:
    """Seconds from ``healed_at`` to the first tick of a job sent to host ``name``'s device as
    soon as the fleet lists it again."""
    from tasks import fan_out
    from tasks.core.errors import DeviceUnavailable

    device = rig.hosts[name].device

    def sent() -> Any:
        try:
            return fan_out({device: ("tick", {"seconds": 0, "marker": str(marker), "label": "after-heal"})}, app=app)
        except DeviceUnavailable:
            return None

    handle = wait_for(sent, timeout, f"{device} to be listed again after the heal", poll=0.1)
    entry = handle.get(timeout=timeout)[device]
    assert entry["status"] == "ok", entry
    return float(entry["output"]["started"]) - healed_at


def cut_long_trial(rig: PartitionRig, app: Any, marker: Path, *, long_s: float = 9.0,
                   cut_after_s: float = 1.0, cut_s: float = 9.0, fault: str = "cut") -> CutFigures:
    """A sweep of a ``long`` and a ``short`` trial over both hosts; the host running ``long``
    is cut off ``cut_after_s`` into it for ``cut_s``, then healed; measured as the issue did.
    ``fault="pause"``: its worker process is paused (SIGSTOP) instead of cut off, then resumed."""
    from tasks import sweep
    from tasks.core import keys

    handle = sweep("tick", [{"seconds": long_s, "label": "long"}, {"seconds": 0.5, "label": "short"}],
                   kwargs={"marker": str(marker)}, app=app)
    job_id = handle.jobs()[0]
    first = wait_for(lambda: runs(marker, job_id), 60, "the long trial to start")[0]
    cut_device = first.device
    cut_name = next(h.name for h in rig.hosts.values() if h.device == cut_device)
    other_device = next(h.device for h in rig.hosts.values() if h.device != cut_device)
    time.sleep(max(0.0, first.first + cut_after_s - time.time()))  # a time into the run, no event
    with (rig.paused(cut_name) if fault == "pause" else rig.partitioned(cut_name)) as cut_at:
        # The trial's run on the other host, if it starts while the cut lasts (cut_s).
        rerun = poll_until(lambda: [r for r in runs(marker, job_id) if r.device == other_device],
                           cut_at + cut_s)
        time.sleep(max(0.0, cut_at + cut_s - time.time()))
    healed_at = time.time()
    back_s = back_after_heal(rig, app, cut_name, healed_at, marker)
    entries = handle.get(timeout=120)
    wait_idle(rig)
    found = runs(marker, job_id)
    with rig.client() as client:
        deaths = list(client.lrange(keys.worker_deaths(job_id), 0, -1))
    return CutFigures(fault=fault, job_id=job_id, cut_device=cut_device, other_device=other_device, runs=found,
                      overlap_s=overlap_s(found),
                      rerun_after_cut_s=(rerun[0].first - cut_at) if rerun else None,
                      back_after_heal_s=back_s, healed_at=healed_at, entry=entries[0], deaths=deaths,
                      statuses=[e["status"] for e in entries])


@dataclass
class SweepFigures:
    """A sweep of many short trials through a cut of one of two hosts (the issue's second)."""

    trials: int
    statuses: list[str]
    #: Every trial's runs, by job id.
    runs: dict[str, list[Run]]
    cut_s: float

    @property
    def ok(self) -> int:
        return self.statuses.count("ok")

    @property
    def never_ran(self) -> list[str]:
        return [job for job, found in self.runs.items() if not found]

    @property
    def ran_twice(self) -> list[str]:
        return [job for job, found in self.runs.items() if len(found) > 1]

    @property
    def overlap_s(self) -> float:
        return max((overlap_s(found) for found in self.runs.values()), default=0.0)

    def report(self) -> str:
        return (f"\nPARTITION sweep of {self.trials} trials through a {self.cut_s:g}-s cut of one of two hosts: "
                f"{self.ok}/{self.trials} ok, {len(self.never_ran)} never ran, {len(self.ran_twice)} ran twice, "
                f"longest overlap of two runs {self.overlap_s:.2f} s")


def sweep_through_cut(rig: PartitionRig, app: Any, marker: Path, name: str, *, trials: int = 30,
                      seconds: float = 0.2, cut_s: float = RECOVERY_BOUND_S + 1.5) -> SweepFigures:
    """``trials`` short trials over both hosts; host ``name`` cut off for ``cut_s`` as soon as
    it has run one, then healed; every entry collected."""
    from tasks import sweep

    handle = sweep("tick", [{"seconds": seconds, "label": f"t{i}"} for i in range(trials)],
                   kwargs={"marker": str(marker)}, app=app)
    device = rig.hosts[name].device
    wait_for(lambda: any(r.device == device for job in handle.jobs().values() for r in runs(marker, job)),
             60, f"{device} to run a trial")
    with rig.partitioned(name) as cut_at:
        time.sleep(max(0.0, cut_at + cut_s - time.time()))  # the cut lasts cut_s
    entries = handle.get(timeout=120)
    wait_idle(rig)
    return SweepFigures(trials=trials, statuses=[e["status"] for e in entries],
                        runs={job: runs(marker, job) for job in handle.jobs().values()}, cut_s=cut_s)


@dataclass
class GangFigures:
    """What a cut of one rank's host did to a distributed job of two ranks, one per host."""

    #: The cut rank's device (rank 0: it also hosts the gang's store) and the survivor's.
    cut_device: str
    survivor_device: str
    #: From the cut to the gang's move to its next generation in Redis (None: not while watched).
    moved_on_after_cut_s: float | None
    #: From the cut to the survivor's rank waiting in that generation: its stuck collective ended.
    survivor_rejoined_after_cut_s: float | None
    #: The gang's generation at the cut (0: it had not moved before).
    generation_at_cut: int
    #: Each rank's entry, by device.
    entries: dict[str, dict[str, Any]]
    #: The deaths counted against the cut rank's job.
    deaths: list[str]
    #: From the send to both ranks summing together, and to both entries.
    assembled_s: float = 0.0
    took_s: float = 0.0

    @property
    def statuses(self) -> dict[str, str]:
        return {device: entry["status"] for device, entry in self.entries.items()}

    @property
    def restarts(self) -> dict[str, Any]:
        return {device: (entry.get("output") or {}).get("restarts") for device, entry in self.entries.items()}

    def report(self) -> str:
        return (f"\nPARTITION gang of 2 ranks, rank 0's host ({self.cut_device}) cut off: the gang moved on "
                f"{_s(self.moved_on_after_cut_s)} after the cut (lease TTL {LEASE_TTL_S:g} s; the collective "
                f"timeout it no longer waits out: 120 s); the survivor on {self.survivor_device} left its collective "
                f"and waited in the next generation {_s(self.survivor_rejoined_after_cut_s)} after the cut; "
                f"entries {self.statuses}, restarts {self.restarts}; deaths counted {len(self.deaths)}; "
                f"the experiment took {self.took_s:.1f} s (the gang summing {self.assembled_s:.1f} s after its send)")


def cut_gang_rank(rig: PartitionRig, app: Any, marker: Path, *, cut_s: float = RECOVERY_BOUND_S + 1.5,
                  watch_s: float = 15.0) -> GangFigures:
    """A distributed ``gang_tick`` over both hosts; rank 0's host is cut off once both ranks
    sum together, for ``cut_s`` (long enough for its job to be given back), then healed; the
    gang's generation and the survivor's membership are watched for ``watch_s`` from the cut."""
    from tasks import fan_out
    from tasks.core import keys

    devices = [host.device for host in rig.hosts.values()]
    cut_name, survivor = next(iter(rig.hosts)), devices[1]
    sent = time.time()
    handle = fan_out("gang_tick", devices, kwargs={"seconds": 60, "restarted_seconds": 0.5, "marker": str(marker)},
                     distributed=True, app=app)
    job_ids = handle.task_ids

    def summed(device: str) -> bool:  # a tick after the first is after a sum with the other rank
        return any(r.last > r.first for r in runs(marker, job_ids[device]) if r.device == device)

    wait_for(lambda: all(summed(d) for d in devices), 90, "both ranks to sum together")
    assembled = time.time() - sent
    with rig.client() as client:
        gang_key = next(k for k in client.scan_iter(match=keys.gang("*"), count=1000)
                        if client.type(k) == "hash")

        def generation() -> int:
            return int(client.hget(gang_key, "gen") or 0)

        moved = rejoined = None
        with rig.partitioned(cut_name) as cut_at:
            at_cut = generation()
            deadline = cut_at + watch_s
            while time.time() < deadline and (moved is None or rejoined is None):
                now = time.time()
                if moved is None and generation() > at_cut:
                    moved = now - cut_at
                if rejoined is None and client.hexists(gang_key, f"m:{at_cut + 1}:1"):
                    rejoined = now - cut_at
                if now >= cut_at + cut_s and moved is not None:
                    break  # heal on time; the survivor's figure is watched on after it
                time.sleep(0.05)
            time.sleep(max(0.0, cut_at + cut_s - time.time()))
        while rejoined is None and time.time() < deadline:
            if client.hexists(gang_key, f"m:{at_cut + 1}:1"):
                rejoined = time.time() - cut_at
            time.sleep(0.05)
        entries = handle.get(timeout=120)
        # The cut worker reports the rank it stopped once it reaches Redis: a death a reaper
        # counted meanwhile is taken back then.
        wait_for(lambda: client.scard(keys.fenced(job_ids[devices[0]])) > 0, 30,
                 "the cut worker to report the rank it stopped")
        deaths = list(client.lrange(keys.worker_deaths(job_ids[devices[0]]), 0, -1))
    wait_idle(rig)
    return GangFigures(cut_device=devices[0], survivor_device=survivor, moved_on_after_cut_s=moved,
                       survivor_rejoined_after_cut_s=rejoined, generation_at_cut=at_cut, entries=entries,
                       deaths=deaths, assembled_s=assembled, took_s=time.time() - sent)
