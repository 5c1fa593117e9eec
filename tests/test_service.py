"""The example service (tasks/examples/service.py) end to end: uvicorn in its own process in
front of the session fleet, driven over real HTTP, an event stream read as a browser reads it,
and one closed mid-stream."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, cli_env, wait_for

pytestmark = pytest.mark.timeout(120)

DEVICES = ["cpu0", "cpu1"]


class Service:
    """The running service: its port and small HTTP helpers (one connection per request)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = self.connect()
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read() or b"null")
        finally:
            conn.close()

    def start(self, **run: Any) -> str:
        status, body = self.call("POST", "/runs", run)
        assert status == 202, body
        return str(body["id"])

    def events(self, run_id: str) -> tuple[http.client.HTTPConnection, Iterator[tuple[str, Any]]]:
        """The run's event stream: ``(connection, iterator of (event, data))``."""
        conn = self.connect()
        conn.request("GET", f"/runs/{run_id}/events")
        reply = conn.getresponse()
        assert reply.status == 200 and reply.getheader("content-type", "").startswith("text/event-stream")

        def read() -> Iterator[tuple[str, Any]]:
            name, data = None, None
            while line := reply.fp.readline():
                text = line.decode().rstrip("\n")
                if text.startswith("event: "):
                    name = text[len("event: "):]
                elif text.startswith("data: "):
                    data = json.loads(text[len("data: "):])
                elif not text and name is not None:
                    yield name, data
                    name, data = None, None

        return conn, read()


@pytest.fixture(scope="module")
def service(fleet, tmp_path_factory) -> Iterator[Service]:
    """uvicorn serving the example app on a socket this fixture bound (no port race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    log = tmp_path_factory.mktemp("service") / "uvicorn.log"
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "tasks.examples.service:app", "--fd", str(sock.fileno()),
             "--log-level", "info"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, pass_fds=[sock.fileno()])
    running = Service(sock.getsockname()[1])
    sock.close()
    try:
        wait_for(lambda: _status(running), 60, "the service to answer", proc=proc)
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(Path(log).read_text()[-3000:])


def _status(service: Service) -> dict[str, Any] | None:
    try:
        status, body = service.call("GET", "/status")
    except OSError:
        return None
    return body if status == 200 else None


def test_a_fan_out_streams_its_progress_in_order_then_returns_its_result(service, tmp_path):
    run_id = service.start(job="counted", devices=DEVICES,
                           kwargs={"marker": str(tmp_path), "seconds": 1.2, "steps": 4, "score": 0.25})
    conn, stream = service.events(run_id)
    events = list(stream)
    conn.close()
    assert events[-1] == ("end", {"id": run_id})
    for device in DEVICES:
        mine = [(name, data) for name, data in events if name != "end" and data["key"] == device]
        steps = [data["progress"]["step"] for name, data in mine if name == "progress"]
        assert steps == sorted(set(steps)) and steps[-1] == 4, steps
        assert mine[-1][0] == "state" and mine[-1][1]["state"] == "SUCCESS"  # the result after the last report
    status, body = service.call("GET", f"/runs/{run_id}/result")
    assert status == 200
    assert {d: (e["status"], e["output"]["score"]) for d, e in body["result"].items()} == \
        {d: ("ok", 0.25) for d in DEVICES}
    finals = {data["key"]: data["entry"] for name, data in events if name == "state" and data["state"] == "SUCCESS"}
    assert finals == body["result"]


def test_a_sweep_returns_every_trial_in_order(service, tmp_path):
    run_id = service.start(job="counted", devices=DEVICES, kwargs={"marker": str(tmp_path)},
                           trials=[{"score": s} for s in (0.3, 0.1, 0.2)], max_concurrent=2)
    status, body = service.call("GET", f"/runs/{run_id}/result?timeout=60")
    assert status == 200
    assert [(e["trial"], e["status"], e["output"]["score"]) for e in body["result"]] == \
        [(0, "ok", 0.3), (1, "ok", 0.1), (2, "ok", 0.2)]


def test_a_client_that_disconnects_mid_stream_leaves_the_run_going(service, tmp_path):
    run_id = service.start(job="counted", devices=DEVICES,
                           kwargs={"marker": str(tmp_path), "seconds": 3.0, "steps": 10, "score": 0.5})
    conn, stream = service.events(run_id)
    first = next(event for event in stream if event[0] == "progress")
    assert first[1]["state"] == "PROGRESS"
    assert _status(service)["streams"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)  # the browser goes away mid-stream
    conn.close()
    # The service notices (Starlette cancels the stream) and lets go of what it held for it.
    wait_for(lambda: _status(service)["streams"] == 0, 30, "the service to close the stream")
    status, body = service.call("GET", f"/runs/{run_id}/result?timeout=60")
    assert status == 200
    assert {d: e["status"] for d, e in body["result"].items()} == {"cpu0": "ok", "cpu1": "ok"}
    # A stream opened after the end says so at once: every job's final state, then end.
    conn, stream = service.events(run_id)
    events = list(stream)
    conn.close()
    assert [name for name, _ in events] == ["state", "state", "end"]


def test_cancel_and_bad_requests(service, tmp_path):
    status, body = service.call("POST", "/runs", {"job": "countd", "devices": DEVICES})
    assert status == 400 and "did you mean 'counted'" in body["detail"]
    status, body = service.call("GET", "/runs/nope/result")
    assert status == 404
    run_id = service.start(job="counted", devices=DEVICES,
                           kwargs={"marker": str(tmp_path), "seconds": 30.0, "steps": 150})
    conn, stream = service.events(run_id)
    next(event for event in stream if event[0] == "progress")
    conn.close()
    status, body = service.call("GET", f"/runs/{run_id}/result?timeout=0.5")
    assert status == 504 and "cpu0" in body["detail"]
    assert service.call("DELETE", f"/runs/{run_id}")[0] == 200
    status, body = service.call("GET", f"/runs/{run_id}/result?timeout=60")
    assert {d: e["status"] for d, e in body["result"].items()} == {"cpu0": "cancelled", "cpu1": "cancelled"}
