"""Flower, started with the fleet: ``celery -A tasks flower`` on loopback, behind basic auth.

Credentials come from ``FLOWER_BASIC_AUTH`` (``user:password``, Flower's own variable) when it
is set; otherwise the fleet generates a password once and keeps ``devicefleet:<password>`` in
``<state_dir>/flower-auth`` (mode 0600), so the same login works across restarts. They reach
Flower through its environment, never its argv (which any user can list).
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from ..core.children import spawn_child
from ..core.defaults import FLOWER_POLL_S, FLOWER_REQUEST_TIMEOUT_S, FLOWER_START_TIMEOUT_S, PROCESS_STOP_TIMEOUT_S
from ..core.errors import FlowerError
from ..core.shadow import python_child
from .proc import free_port, log_tail, stop_process, wait_until

logger = logging.getLogger(__name__)

AUTH_ENV = "FLOWER_BASIC_AUTH"
AUTH_FILE = "flower-auth"
DEFAULT_USER = "devicefleet"


def credentials(state_dir: Path) -> tuple[str, Path | None]:
    """``("user:password", file)``: from ``FLOWER_BASIC_AUTH`` (file None), else the state dir's file.

    Raises:
        FlowerError: ``FLOWER_BASIC_AUTH`` is set but not ``user:password``.
    """
    given = os.environ.get(AUTH_ENV)
    if given:
        if ":" not in given.split(",")[0]:
            raise FlowerError(f"{AUTH_ENV} must be user:password (comma-separated for several), "
                              f"got a value with no ':'")
        return given, None
    path = state_dir / AUTH_FILE
    try:
        text = path.read_text().strip()
        if ":" in text:
            return text, path
    except FileNotFoundError:
        pass
    text = f"{DEFAULT_USER}:{secrets.token_urlsafe(18)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text + "\n")
    return text, path


def auth_header(basic_auth: str) -> str:
    """The ``Authorization`` header value for the first ``user:password`` of ``basic_auth``."""
    return "Basic " + base64.b64encode(basic_auth.split(",")[0].encode()).decode()


class FlowerProcess:
    """One ``celery flower`` process for a fleet's Redis."""

    def __init__(self, redis_url: str, state_dir: Path, port: int = 0, host: str = "127.0.0.1",
                 extra_env: dict[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.state_dir = state_dir
        self.host = host
        self.port = port or free_port(host)
        self.extra_env = dict(extra_env or {})
        self.basic_auth, self.auth_file = credentials(state_dir)
        self.log = state_dir / "logs" / "flower.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = FLOWER_START_TIMEOUT_S) -> FlowerProcess:
        """Start Flower and wait until it answers an authenticated request.

        Raises:
            FlowerError: Flower exited or did not answer within ``timeout``; the message has the
                tail of its log.
        """
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update({"DEVICEFLEET_REDIS_URL": self.redis_url, AUTH_ENV: self.basic_auth,
                    "PYTHONUNBUFFERED": "1"})
        # `celery -A tasks flower`, through tasks.ops.celery_main so that a tasks.py in the
        # working directory is never the app (tasks.core.shadow).
        argv, env = python_child("tasks.ops.celery_main", "-A", "tasks", "flower",
                                 f"--address={self.host}", f"--port={self.port}",
                                 # Flower forgets workers that stay offline this long (seconds).
                                 "--purge_offline_workers=3600", env=env)
        with open(self.log, "ab") as log:
            self.process = spawn_child(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        try:
            wait_until(self._answers, timeout, f"flower to answer at {self.url}/healthcheck", poll=FLOWER_POLL_S,
                       proc=self.process, error=FlowerError,
                       detail=lambda: f"log {self.log}: {log_tail(self.log)}")
        except FlowerError:
            self.stop()
            raise
        logger.info("flower at %s (pid %d)", self.url, self.process.pid)
        return self

    def _answers(self) -> bool:
        request = urllib.request.Request(f"{self.url}/healthcheck",
                                         headers={"Authorization": auth_header(self.basic_auth)})
        try:
            with urllib.request.urlopen(request, timeout=FLOWER_REQUEST_TIMEOUT_S) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = PROCESS_STOP_TIMEOUT_S) -> None:
        stop_process(self.process, timeout)
