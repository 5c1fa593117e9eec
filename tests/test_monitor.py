"""Monitoring against a real fleet: Flower (seen in headless Chromium), Flower's /metrics, the
fleet's exporter and ``devicefleet status`` must all agree with the jobs each device ran.

The module runs its own fleet (two CPU devices, Flower, exporter) on its own embedded Redis,
and keeps a ledger of every fan-out it sends, so the expected counts are exact whatever order
the tests run in. Each job is the Celery task ``devicefleet.<job>``. Flower's "Processed"
counts every task a worker received: the device's jobs plus the chord ``collect`` steps it
happened to run (the ledger knows which worker ran each); its "Failed" counts the jobs that
failed (their tasks end in FAILURE), and its "Succeeded" the others plus the collect steps.
"""

from __future__ import annotations

import gc
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from tasks import FanOut, Fleet, fan_out
from tasks.core.devices import host_name
from tasks.core.job import COLLECT_TASK, task_name
from tasks.ops.flower import auth_header, credentials
from tasks.ops.progress_view import describe, fraction, watch

from .browser import chromium, screenshot
from .conftest import ROOT, http_status, make_settings, wait_for
from .conftest import test_env as child_env

DEVICES = ["cpu0", "cpu1"]
N = 3


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exported_names(url: str, auth: str | None = None) -> set[str]:
    """Every metric a page exports: family names (with or without series) and sample names."""
    headers = {"Authorization": auth_header(auth)} if auth else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    names = {f.name for f in families} | {s.name for f in families for s in f.samples}
    return names | {f"{f.name}_total" for f in families if f.type == "counter"}


def scrape(url: str, auth: str | None = None) -> Samples:
    """Every sample of a Prometheus text page: ``{(name, labels): value}``."""
    headers = {"Authorization": auth_header(auth)} if auth else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def flower_api(mon: Monitored, path: str, **query: str) -> Any:
    """GET one of Flower's API endpoints with the fleet's basic-auth credentials."""
    url = mon.flower_url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
    req = urllib.request.Request(url, headers={"Authorization": auth_header(mon.auth)})
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


@dataclass
class Monitored:
    fleet: Fleet
    flower_url: str
    auth: str
    metrics_url: str
    #: The ledger: every fan-out the module sent.
    handles: list[FanOut] = field(default_factory=list)
    producer: Any = None

    def app(self) -> Any:
        """One producer app for the module (a new app per call would leave its sockets to GC)."""
        if self.producer is None:
            self.producer = self.fleet.app()
        return self.producer

    def worker(self, device: str) -> str:
        return f"{device}@{host_name()}"

    def send(self, jobs: Any, devices: Any = "all") -> FanOut:
        handle = fan_out(jobs, devices, app=self.app())
        self.handles.append(handle)
        return handle

    def run(self, jobs: Any, devices: Any = "all", timeout: float = 120) -> dict[str, Any]:
        return self.send(jobs, devices).get(timeout=timeout)

    def outcomes(self) -> Counter[tuple[str, str, str]]:
        """``(device, Celery task name, entry status)`` of every job sent, counted."""
        counts: Counter[tuple[str, str, str]] = Counter()
        for h in self.handles:
            results = h.get(timeout=60)
            for device, spec in h.plan.items():
                counts[(device, task_name(spec.name), results[device]["status"])] += 1
        return counts

    def jobs_per_device(self, status: str | None = None) -> Counter[str]:
        """Jobs each device ran (only those whose entry has ``status``, if given)."""
        counts: Counter[str] = Counter()
        for (device, _, st), n in self.outcomes().items():
            if status is None or st == status:
                counts[device] += n
        return counts

    def collectors(self) -> Counter[str]:
        """The worker that ran each fan-out's collect step, counted."""
        counts: Counter[str] = Counter()
        for h in self.handles:
            h.get(timeout=60)  # the collect step's result: it has finished
            # result_extended records the worker of each task; FanOut.id is the collect task's.
            collector = self.app().AsyncResult(h.id).worker
            assert collector, f"no worker recorded for collect step {h.id}"
            counts[str(collector)] += 1
        return counts

    def tasks_per_worker(self) -> Counter[str]:
        """Tasks each worker received: its device's jobs plus the collect steps it ran."""
        counts = Counter({self.worker(d): n for d, n in self.jobs_per_device().items()})
        counts.update(self.collectors())
        return counts

    def status_json(self) -> dict[str, Any]:
        env = {**os.environ, **child_env(), "DEVICEFLEET_STATE_DIR": str(self.fleet.settings.state_dir)}
        out = subprocess.run([sys.executable, "-m", "tasks", "status", "--json"], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        return dict(json.loads(out.stdout))


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    settings = make_settings(tmp_path_factory.mktemp("monitored"))
    with Fleet(settings, cpu_workers=2, stop_timeout=20, extra_env=child_env(), flower=True).start() as fleet:
        info = fleet.describe()
        auth, _ = credentials(settings.state_dir)
        monitored = Monitored(fleet, info["flower_url"], auth, info["metrics_url"])
        yield monitored
        # Results unsubscribe from Redis when collected: let them go while Redis still runs.
        monitored.handles.clear()
        if monitored.producer is not None:
            monitored.producer.close()
        gc.collect()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


def flower_page(browser: Any, mon: Monitored) -> Any:
    user, password = mon.auth.split(":", 1)
    context = browser.new_context(http_credentials={"username": user, "password": password},
                                  viewport={"width": 1400, "height": 900})
    return context.new_page()


# -- tests ---------------------------------------------------------------------------------------


def test_flower_runs_on_loopback_behind_basic_auth(monitored: Monitored) -> None:
    assert monitored.flower_url.startswith("http://127.0.0.1:")
    auth_file = monitored.fleet.settings.state_dir / "flower-auth"
    assert auth_file.stat().st_mode & 0o777 == 0o600
    assert auth_file.read_text().strip() == monitored.auth
    user = monitored.auth.split(":", 1)[0]
    for path in ("/", "/workers", "/tasks", "/api/workers", "/api/tasks"):
        assert http_status(monitored.flower_url + path) == 401, path
        assert http_status(monitored.flower_url + path, f"{user}:wrong-password") == 401, path
        assert http_status(monitored.flower_url + path, monitored.auth) == 200, path
    # Flower serves /metrics (and /healthcheck) to anyone who reaches it, for Prometheus; it
    # listens on loopback only.
    assert http_status(monitored.flower_url + "/metrics") == 200
    # The password is never in Flower's argv, which every local user can read.
    assert monitored.fleet.monitor is not None and monitored.fleet.monitor.flower is not None
    flower = monitored.fleet.monitor.flower.process
    assert flower is not None
    cmdline = Path(f"/proc/{flower.pid}/cmdline").read_bytes().decode()
    assert monitored.auth.split(":", 1)[1] not in cmdline


@pytest.mark.tools
def test_flower_metrics_and_ui_agree_with_the_jobs_each_device_ran(
    monitored: Monitored, browser: Any, unchecked_kwargs: None
) -> None:
    handles_before = len(monitored.handles)
    for _ in range(N):
        results = monitored.run("echo")
        assert set(results) == set(DEVICES) and all(e["status"] == "ok" for e in results.values())
    # Two jobs that fail on purpose: one raises, one gets kwargs its schema refuses (at the
    # worker: unchecked_kwargs keeps the producer from refusing them first).
    failing = monitored.send({"cpu0": ("fail", {"message": "on purpose"}), "cpu1": ("train", {"epochs": "many"})})
    results = failing.get(timeout=60)
    assert results["cpu0"]["error"]["type"] == "ValueError"
    assert results["cpu1"]["error"]["type"] == "InvalidJobArguments"
    assert failing.states() == {"cpu0": "FAILURE", "cpu1": "FAILURE"}
    assert len(monitored.handles) - handles_before == N + 1
    outcomes = monitored.outcomes()
    ok, failed = monitored.jobs_per_device("ok"), monitored.jobs_per_device("error")
    assert all(failed[d] >= 1 for d in DEVICES)
    collected = monitored.collectors()
    tasks = monitored.tasks_per_worker()
    job_tasks = {t for _, t, _ in outcomes}

    # Flower's own /metrics: per worker and task name, succeeded and failed events == the ledger.
    def flower_caught_up() -> bool:
        got = scrape(monitored.flower_url + "/metrics", monitored.auth)
        return all(
            sample(got, "flower_events_total", worker=monitored.worker(d), type=event, task=t)
            == outcomes[(d, t, status)]
            for d in DEVICES for t in job_tasks
            for event, status in (("task-succeeded", "ok"), ("task-failed", "error"))
        ) and all(sample(got, "flower_worker_online", worker=monitored.worker(d)) == 1 for d in DEVICES)

    wait_for(flower_caught_up, 60, "Flower's /metrics counting every job")
    flower = scrape(monitored.flower_url + "/metrics", monitored.auth)
    for d in DEVICES:
        w = monitored.worker(d)
        received = sum(
            sample(flower, "flower_events_total", worker=w, type="task-received", task=t)
            for t in job_tasks | {COLLECT_TASK}
        )
        assert received == tasks[w]
        assert sample(flower, "flower_events_total", worker=w, type="task-succeeded",
                      task=COLLECT_TASK) == collected[w]
        for t in job_tasks:  # a runtime for each job that succeeded
            assert sample(flower, "flower_task_runtime_seconds_count", worker=w, task=t) == outcomes[(d, t, "ok")]

    # Flower's task API: the job that got bad kwargs, listed as FAILURE under its own task name.
    bad_id = failing.task_ids["cpu1"]
    listed = wait_for(lambda: flower_api(monitored, "/api/tasks", state="FAILURE").get(bad_id), 60,
                      "Flower's /api/tasks listing the job with bad kwargs as FAILURE")
    assert listed["name"] == "devicefleet.train" and listed["state"] == "FAILURE"
    assert listed["worker"] == monitored.worker("cpu1")
    assert "InvalidJobArguments" in listed["exception"]
    raised = flower_api(monitored, "/api/tasks", state="FAILURE")[failing.task_ids["cpu0"]]
    assert raised["name"] == "devicefleet.fail" and "on purpose" in raised["exception"]

    # The fleet's exporter: exact counts per device, from the workers' own counters.
    fleet = scrape(monitored.metrics_url)
    for d in DEVICES:
        assert sample(fleet, "devicefleet_jobs_total", device=d, kind="cpu", status="ok") == ok[d]
        assert sample(fleet, "devicefleet_jobs_total", device=d, kind="cpu", status="error") == failed[d]
        assert sample(fleet, "devicefleet_worker_online", device=d, kind="cpu") == 1
        assert sample(fleet, "devicefleet_jobs_per_second", device=d, kind="cpu") > 0

    # Flower's web UI, in a real browser: each device worker's processed, failed and succeeded.
    page = flower_page(browser, monitored)
    page.goto(monitored.flower_url + "/workers")

    def table() -> dict[str, tuple[int, ...]]:
        # DataTables (scrollX) draws a copy of the header; the table's own keeps the column names.
        headers = [(h.text_content() or "").strip() for h in page.locator("#workers-table thead th").all()]
        if not {"Worker", "Processed", "Failed", "Succeeded"} <= set(headers):
            return {}
        cols = [headers.index(name) for name in ("Processed", "Failed", "Succeeded")]
        shown = {}
        for row in page.locator("#workers-table tbody tr").all():
            cells = [c.inner_text().strip() for c in row.locator("td").all()]
            if len(cells) > max(cols) and "@" in cells[headers.index("Worker")]:
                shown[cells[headers.index("Worker")]] = tuple(
                    int(cells[i].replace(",", "") or 0) for i in cols)
        return shown if set(shown) >= {monitored.worker(d) for d in DEVICES} else {}

    expected: dict[str, tuple[int, ...]] = {
        monitored.worker(d): (tasks[monitored.worker(d)], failed[d], ok[d] + collected[monitored.worker(d)])
        for d in DEVICES
    }
    shown: list[dict[str, tuple[int, ...]]] = []

    def table_agrees() -> bool:
        shown.append(table())
        if shown[-1] == expected:
            return True
        page.reload()
        return False

    try:
        wait_for(table_agrees, 60, "Flower's workers table showing the ledger's counts")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: want (processed, failed, succeeded) {expected}, "
                             f"last shown {shown[-1] if shown else None}") from None
    screenshot(page, "flower-workers.png")
    page.context.close()

    # devicefleet status --json: the same counts, Flower's URL, the queues.
    status = monitored.status_json()
    assert status["flower_url"] == monitored.flower_url
    assert status["metrics_url"] == monitored.metrics_url
    for d in DEVICES:
        assert status["devices"][d]["jobs_ok"] == ok[d]
        assert status["devices"][d]["jobs_error"] == failed[d]
        assert status["devices"][d]["live"] is True
        assert status["devices"][d]["jobs_per_s"] > 0
    assert {"cpu", "fleet", "device.cpu0", "device.cpu1"} <= set(status["queues"])


def test_queue_depth_and_oldest_age_while_a_device_does_not_consume(monitored: Monitored) -> None:
    app = monitored.app()
    worker = monitored.worker("cpu0")
    replies = app.control.cancel_consumer("device.cpu0", destination=[worker], reply=True, timeout=10)
    assert replies, "cpu0 did not answer cancel_consumer"
    handles = []
    try:
        for _ in range(2):
            handles.append(monitored.send({"cpu0": "echo"}))

        def queued() -> Samples | None:
            got = scrape(monitored.metrics_url)
            return got if sample(got, "devicefleet_queue_length", queue="device.cpu0") == 2 else None

        wait_for(queued, 30, "device.cpu0 holding 2 messages")

        def aged() -> Samples:  # the waiting messages' age grows while nothing consumes
            got = scrape(monitored.metrics_url)
            return got if sample(got, "devicefleet_queue_oldest_age_seconds", queue="device.cpu0") >= 0.2 else {}

        got = wait_for(aged, 30, "the oldest message on device.cpu0 to be 0.2 s old")
        assert sample(got, "devicefleet_queue_length", queue="device.cpu0") == 2
        assert sample(got, "devicefleet_queue_length", queue="device.cpu1") == 0
        status = monitored.status_json()
        assert status["queues"]["device.cpu0"]["depth"] == 2
        assert status["queues"]["device.cpu0"]["oldest_age_s"] >= 0.2
        text = subprocess.run(
            [sys.executable, "-m", "tasks", "status"], capture_output=True, text=True, timeout=60,
            env={**os.environ, **child_env(), "COLUMNS": "200",
                 "DEVICEFLEET_STATE_DIR": str(monitored.fleet.settings.state_dir)}, check=True,
        ).stdout
        assert re.search(r"^\s*device\.cpu0\s+2\s+\d+\.\ds\s*$", text, re.MULTILINE), text
        assert "jobs/s" in text and "samples/s" in text and monitored.flower_url in text
    finally:
        app.control.add_consumer("device.cpu0", destination=[worker], reply=True, timeout=10)
    for handle in handles:
        assert handle.get(timeout=60)["cpu0"]["status"] == "ok"
    assert sample(scrape(monitored.metrics_url), "devicefleet_queue_length", queue="device.cpu0") == 0


@pytest.mark.tools
def test_progress_reaches_producers_status_and_flower(
    monitored: Monitored, browser: Any, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    handle = monitored.send({"cpu1": ("hold", {"steps": 4, "release_file": str(release)})})
    try:
        # The producer: PROGRESS meta from the result backend.
        def at_step_4() -> dict[str, dict[str, Any]]:
            progress = handle.progress()
            return progress if progress["cpu1"].get("step") == 4 else {}

        progress = wait_for(at_step_4, 60, "step 4 in the fan-out's progress")
        assert progress["cpu1"] == {"device": "cpu1", "step": 4, "total": 4, "loss": 0.25}
        assert handle.states()["cpu1"] == "PROGRESS"
        # devicefleet status: busy with the job, at step 4/4.
        dev = wait_for(lambda: monitored.status_json()["devices"]["cpu1"].get("progress"), 30,
                       "progress in the registry")
        assert dev["step"] == 4
        # Flower: task state PROGRESS, from the task-progress event.
        task_id = handle.task_ids["cpu1"]
        info_url = f"{monitored.flower_url}/api/task/info/{task_id}"

        def flower_state() -> str:
            req = urllib.request.Request(info_url, headers={"Authorization": auth_header(monitored.auth)})
            try:
                with urllib.request.urlopen(req, timeout=10) as reply:
                    return str(json.loads(reply.read())["state"])
            except urllib.error.HTTPError:
                return ""

        wait_for(lambda: flower_state() == "PROGRESS", 30, "Flower showing the task as PROGRESS")
        page = flower_page(browser, monitored)
        page.goto(f"{monitored.flower_url}/task/{task_id}")
        page.wait_for_selector("text=PROGRESS", timeout=30_000)
        # The report's fields, where Flower's task page shows them (its Result row).
        page.wait_for_selector("text=progress: step=4 total=4 loss=0.25", timeout=30_000)
        screenshot(page, "flower-task-progress.png")
        page.context.close()
        # The CLI's live bars (what `devicefleet run` draws), built on the same handle.
        out = io.StringIO()
        console = Console(file=out, force_terminal=True, width=120, color_system=None)
        watcher = threading.Thread(target=watch, args=(handle, console), kwargs={"interval_s": 0.05})
        watcher.start()
        wait_for(lambda: re.search(r"cpu1 .*4/4 PROGRESS loss=0\.25", out.getvalue()), 30,
                 "a bar at 4/4 with the loss")
    finally:
        release.touch()
    watcher.join(timeout=60)
    assert not watcher.is_alive()
    assert "SUCCESS" in out.getvalue()
    assert handle.get(timeout=60)["cpu1"]["status"] == "ok"
    # The latest report stays readable once the job has finished.
    assert handle.progress()["cpu1"] == {"device": "cpu1", "step": 4, "total": 4, "loss": 0.25}
    wait_for(lambda: flower_state() == "SUCCESS", 30, "Flower showing the task as SUCCESS")


def test_dashboard_and_alerts_use_only_exported_metrics(monitored: Monitored) -> None:
    # Flower's runtime histogram has no series until it has processed a finished task, so the test
    # runs its own job on every device and waits until Flower has counted it (not relying on jobs
    # that other tests may or may not have run before it).
    echo = task_name("echo")

    def runtimes() -> dict[str, float]:
        """Each device's count of ``echo`` runtimes in Flower's histogram; -1 without its buckets."""
        got = scrape(monitored.flower_url + "/metrics", monitored.auth)
        bucketed = {dict(labels).get("worker") for name, labels in got
                    if name == "flower_task_runtime_seconds_bucket" and dict(labels).get("task") == echo}
        return {d: sample(got, "flower_task_runtime_seconds_count", worker=monitored.worker(d), task=echo)
                if monitored.worker(d) in bucketed else -1.0 for d in DEVICES}

    before = runtimes()
    results = monitored.run("echo")  # so that every per-task series exists
    assert set(results) == set(DEVICES) and all(e["status"] == "ok" for e in results.values()), results
    seen: list[dict[str, float]] = []

    def flower_saw_the_job() -> bool:
        seen.append(runtimes())
        return all(seen[-1][d] >= max(before[d], 0) + 1 for d in DEVICES)

    try:
        wait_for(flower_saw_the_job, 60,
                 f"Flower's /metrics recording the runtime of {echo} on each device "
                 "(flower_task_runtime_seconds_bucket and _count)")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: flower_task_runtime_seconds_count before the job {before}, "
                             f"last scraped {seen[-1] if seen else None}") from None
    exported = exported_names(monitored.metrics_url)
    exported |= exported_names(monitored.flower_url + "/metrics", monitored.auth)
    deploy = ROOT / "deploy"
    dashboard = json.loads((deploy / "grafana" / "devicefleet-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 4
    rules = yaml.safe_load((deploy / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:flower|devicefleet)_[a-z_]+\b", e)}
    assert used, exprs
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    for wanted in ("devicefleet_jobs_total", "devicefleet_queue_length", "flower_worker_online",
                   "flower_task_runtime_seconds_bucket", "devicefleet_samples_per_second"):
        assert wanted in used, f"the dashboard or alerts miss {wanted}"
    scrape_config = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape_config["scrape_configs"]}
    assert {"flower", "devicefleet"} <= set(jobs)


def test_status_watch_refreshes_in_place_until_ctrl_c(monitored: Monitored) -> None:
    import pty
    import select
    import signal

    master, slave = pty.openpty()
    env = {**os.environ, **child_env(), "COLUMNS": "160", "LINES": "60", "TERM": "xterm",
           "DEVICEFLEET_STATE_DIR": str(monitored.fleet.settings.state_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "tasks", "status", "--watch", "--interval", "0.2"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        # Two full drawings: the first and at least one refresh.
        while seen.count(b"device.cpu0") < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        assert seen.count(b"device.cpu0") >= 2, seen.decode(errors="replace")[-2000:]
        assert b"jobs/s" in seen and b"\x1b[" in seen  # redrawn with cursor moves, in place
        proc.send_signal(signal.SIGINT)
        # Read on, as a terminal does, until it exits: its last frame (and the frames it drew
        # since the last read) must find room in the terminal, or its write blocks for ever
        # (a pty holds a few KiB; on a loaded host the frames fill it before the SIGINT comes).
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    break
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"status --watch still running after Ctrl-C; its stacks:\n{_stacks(proc.pid)}")
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def _stacks(pid: int) -> str:
    """A stuck process's Python stacks (py-spy, where installed), for the failure message."""
    import shutil

    spy = shutil.which("py-spy")
    if spy is None:
        return "(py-spy not installed)"
    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return dump.stdout + dump.stderr


def test_progress_fields_to_bar() -> None:
    assert fraction({"epoch": 3, "epochs": 15, "loss": 0.2}) == (3.0, 15.0)
    assert fraction({"step": 5, "total": 10}) == (5.0, 10.0)
    assert fraction({"loss": 0.2}) is None
    assert fraction({"step": 1, "total": 0}) is None
    assert describe({"device": "cpu0", "epoch": 3, "epochs": 15, "loss": 0.21345}) == "loss=0.2135"
