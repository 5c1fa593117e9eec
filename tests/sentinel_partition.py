"""Redis Sentinel under a network partition (issue 39, item 5; Jepsen's Redis case, 2013).

Two network namespaces joined by one veth: side ``a`` holds the primary, side ``b`` its two
replicas and the three sentinels. A cut of the link (the drop qdisc of tests/partition_rig.py)
leaves the primary alone with whoever writes to it from its own side, while the majority side
fails over. The test process reaches every Redis through its unix socket (namespaces share the
filesystem), which no cut touches: it plays the worker on the primary's side, and reads the
replicas on the other. The primary uses the ``min-replicas-*`` lines of the rendered deployment
(deploy/redis-devicefleet-replicated.conf).
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tasks.ops.redis_server import find_redis_server

from . import system_tools
from .conftest import ROOT, wait_for
from .partition_rig import SUBNET, PartitionRig, require_tools, run_tool, stop_process
from .sentinel_cluster import DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, MASTER_NAME

#: The rendered deployment's Redis config, whose min-replicas lines the primary runs with.
DEPLOYED_CONF = ROOT / "deploy" / "redis-devicefleet-replicated.conf"
SIDE_A = f"{SUBNET}.9.1"
SIDE_B = f"{SUBNET}.9.2"


def deployed_min_replicas() -> dict[str, int]:
    """``{"min-replicas-to-write": n, "min-replicas-max-lag": s}`` as the deployment renders them."""
    text = DEPLOYED_CONF.read_text()
    return {key: int(re.search(rf"^{key} (\d+)$", text, flags=re.MULTILINE).group(1))  # type: ignore[union-attr]
            for key in ("min-replicas-to-write", "min-replicas-max-lag")}


@dataclass
class RedisNode:
    name: str
    netns: str
    address: str
    port: int
    socket: Path
    process: subprocess.Popen[bytes] | None = None


@dataclass
class SentinelPartition:
    """The primary on side ``a``, replicas and sentinels on side ``b``; see the module."""

    rig: PartitionRig
    password: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    nodes: list[RedisNode] = field(default_factory=list)
    sentinels: list[RedisNode] = field(default_factory=list)

    @property
    def side_a(self) -> str:
        return f"dfp-{self.rig.tag}-a"

    @property
    def side_b(self) -> str:
        return f"dfp-{self.rig.tag}-b"

    @property
    def link(self) -> tuple[str, str]:
        return f"dfa{self.rig.tag}", f"dfb{self.rig.tag}"

    def build(self) -> None:
        rig = self.rig
        rig._netns(self.side_a)
        rig._netns(self.side_b)
        veth_a, veth_b = self.link
        run_tool([rig.ip, "link", "add", veth_a, "netns", self.side_a, "type", "veth",
              "peer", "name", veth_b, "netns", self.side_b])
        for netns, dev, address in ((self.side_a, veth_a, SIDE_A), (self.side_b, veth_b, SIDE_B)):
            run_tool([rig.ip, "-n", netns, "addr", "add", f"{address}/24", "dev", dev])
            run_tool([rig.ip, "-n", netns, "link", "set", dev, "up"])
        binary = find_redis_server()
        limits = deployed_min_replicas()
        folder = rig.folder
        self.nodes = [RedisNode("redis0", self.side_a, SIDE_A, 6379, folder / "redis0.sock"),
                      RedisNode("redis1", self.side_b, SIDE_B, 6380, folder / "redis1.sock"),
                      RedisNode("redis2", self.side_b, SIDE_B, 6381, folder / "redis2.sock")]
        primary = self.nodes[0]
        for node in self.nodes:
            lines = [f"bind {node.address}", f"port {node.port}", f"unixsocket {node.socket}", "unixsocketperm 700",
                     f"dir {folder}", f"dbfilename {node.name}.rdb", f"requirepass {self.password}",
                     f"masterauth {self.password}", 'save ""', "appendonly no", "daemonize no",
                     f"logfile {folder / node.name}.log",
                     *(f"{key} {value}" for key, value in limits.items())]
            if node is not primary:
                lines.append(f"replicaof {primary.address} {primary.port}")
            self._start(node, binary, "\n".join(lines) + "\n", sentinel=False)
        for i in range(3):
            node = RedisNode(f"sentinel{i}", self.side_b, SIDE_B, 26379 + i, folder / f"sentinel{i}.sock")
            conf = "\n".join([
                f"bind {node.address}", f"port {node.port}", f"dir {folder}", "daemonize no",
                f"logfile {folder / node.name}.log",
                f"sentinel monitor {MASTER_NAME} {primary.address} {primary.port} 2",
                f"sentinel auth-pass {MASTER_NAME} {self.password}",
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
                f"sentinel parallel-syncs {MASTER_NAME} 1",
            ]) + "\n"
            self._start(node, binary, conf, sentinel=True)
            self.sentinels.append(node)
        wait_for(lambda: self.synced_replicas(primary) == 2, 30, "both replicas in sync")
        # Each look starts a probe in side b's namespace: look twice a second, not twenty times.
        wait_for(self._sentinels_ready, 30, "the sentinels to find each other and both replicas", poll=0.5)

    def _start(self, node: RedisNode, binary: Path, conf: str, sentinel: bool) -> None:
        path = self.rig.folder / f"{node.name}.conf"
        path.touch(mode=0o600)
        path.write_text(conf)
        argv = [self.rig.ip, "netns", "exec", node.netns, "nice", "-n", "-10", str(binary), str(path)]
        node.process = subprocess.Popen([*argv, *(["--sentinel"] if sentinel else [])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not sentinel:
            wait_for(node.socket.exists, 20, f"{node.name}'s socket", proc=node.process)

    def close(self) -> None:
        stop_process(*(node.process for node in [*self.sentinels, *self.nodes]))

    # -- looking -------------------------------------------------------------------------------

    def client(self, node: RedisNode, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(node.socket), password=self.password, decode_responses=True,
                           socket_timeout=timeout, socket_connect_timeout=timeout)

    def role(self, node: RedisNode) -> str | None:
        try:
            with self.client(node) as client:
                return str(client.info("replication")["role"])
        except redis.RedisError:
            return None

    def synced_replicas(self, node: RedisNode) -> int:
        try:
            with self.client(node) as client:
                info = client.info("replication")
        except redis.RedisError:
            return 0
        return sum(1 for key, value in info.items()
                   if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")

    def _sentinels_ready(self) -> bool:
        probe = ("import redis,sys; c=redis.Redis(host=sys.argv[1], port=int(sys.argv[2])); "
                 f"m=c.execute_command('SENTINEL','master','{MASTER_NAME}'); "
                 "f=dict(zip(m[::2],m[1::2])) if isinstance(m,list) else m; "
                 "sys.exit(0 if int(f.get(b'num-other-sentinels',f.get('num-other-sentinels',0)))==2 and "
                 "int(f.get(b'num-slaves',f.get('num-slaves',0)))==2 else 1)")
        for node in self.sentinels:
            done = subprocess.run([self.rig.ip, "netns", "exec", node.netns, sys.executable, "-c", probe,
                                   node.address, str(node.port)], capture_output=True, timeout=20)
            if done.returncode != 0:
                return False
        return True

    # -- the cut -------------------------------------------------------------------------------

    def cut(self) -> None:
        for netns, dev in zip((self.side_a, self.side_b), self.link, strict=True):
            run_tool([self.rig.ip, "netns", "exec", netns, self.rig.tc, "qdisc", "add", "dev", dev,
                  "root", "pfifo", "limit", "0"])

    def heal(self) -> None:
        for netns, dev in zip((self.side_a, self.side_b), self.link, strict=True):
            run_tool([self.rig.ip, "netns", "exec", netns, self.rig.tc, "qdisc", "del", "dev", dev, "root"])


@contextmanager
def sentinel_partition() -> Iterator[SentinelPartition]:
    """A started :class:`SentinelPartition`; every process, namespace and file removed after."""
    ip, tc = require_tools()
    system_tools.tool("nice", "coreutils")
    with ExitStack() as stack:
        folder = Path(tempfile.mkdtemp(prefix="dfs-"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        rig = PartitionRig(ip=ip, tc=tc, folder=folder)
        stack.callback(rig.close)
        cluster = SentinelPartition(rig)
        stack.callback(cluster.close)
        cluster.build()
        yield cluster
