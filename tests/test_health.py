"""The GPU health service (issue 50 item 1): its pure judgements, and the service in process
against the fake NVML (tests/fake_nvml/pynvml.py) with a real Redis: events, failures, hangs
under the watchdog while a real heartbeat keeps beating."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tasks.core import keys
from tasks.core.device_state import DeviceState, read_state, write_state
from tasks.core.errors import DeviceFailed
from tasks.core.records import WorkerRecord
from tasks.core.wire import STOPS, Outcome, StopJob, StopReason
from tasks.core.xids import count_xid, read_xid_counts
from tasks.ops.exporter import FleetCollector
from tasks.worker.admission import sent_by_name
from tasks.worker.health import (
    XIDS,
    Action,
    HealthService,
    NvmlCaller,
    NvmlHung,
    Reading,
    Verdict,
    classify_nvml_error,
    classify_xid,
    judge_reading,
)
from tasks.worker.heartbeat import Heartbeat
from tasks.worker.lease import LeaseKeeper
from tasks.worker.supervisor import Ended

from .conftest import test_env, wait_for

pytestmark = pytest.mark.timeout(60)

FAKE_NVML = Path(__file__).parent / "fake_nvml" / "pynvml.py"


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh copy of the fake NVML module; ``nvml.scenario(dict)`` writes its scenario."""
    spec = importlib.util.spec_from_file_location(f"fake_pynvml_{id(tmp_path)}", FAKE_NVML)
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "scenario.json"
    monkeypatch.setenv(module.SCENARIO_ENV, str(path))

    def scenario(data: dict[str, Any]) -> None:
        path.write_text(json.dumps(data))

    module.scenario = scenario
    scenario({})
    yield module
    module.release()


def service(client: Any, nvml: ModuleType, **kwargs: Any) -> HealthService:
    options: dict[str, Any] = {"timeout_s": 0.5, "event_wait_s": 0.1, "poll_s": 0.2, **kwargs}
    return HealthService(client, "gpu0", nvml, 0, **options)


# -- pure judgements ------------------------------------------------------------------------------


@pytest.mark.parametrize("xid", [13, 31, 43])
def test_an_applications_own_xid_is_only_watched(xid: int) -> None:
    verdict = classify_xid(xid)
    assert verdict.action is Action.WATCH and verdict.xid == xid
    assert verdict.reason.startswith(f"Xid {xid}: ")


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120])
def test_a_hardware_xid_drains_the_device(xid: int) -> None:
    verdict = classify_xid(xid)
    assert verdict.action is Action.DRAIN
    assert f"Xid {xid}" in verdict.reason and "\n" not in verdict.reason


def test_an_xid_outside_the_table_is_watched_and_said_so() -> None:
    assert 9999 not in XIDS
    verdict = classify_xid(9999)
    assert verdict.action is Action.WATCH and "not in devicefleet's table" in verdict.reason


def test_nvml_errors_fail_closed_but_not_supported_is_fine(nvml: Any) -> None:
    assert classify_nvml_error("nvmlDeviceGetRemappedRows", nvml.NVMLError_NotSupported("no"), nvml) is None
    suspect = classify_nvml_error("nvmlDeviceGetTotalEccErrors", nvml.NVMLError_Unknown("boom"), nvml)
    assert suspect is not None and suspect.action is Action.SUSPECT
    assert "nvmlDeviceGetTotalEccErrors" in suspect.reason and "boom" in suspect.reason
    lost = classify_nvml_error("nvmlEventSetWait", nvml.NVMLError_GpuIsLost("gone"), nvml)
    assert lost is not None and lost.action is Action.DRAIN


def test_a_reading_drains_on_new_uncorrected_errors_pending_or_failed_rows_and_recovery() -> None:
    first = Reading(ecc_uncorrected=2, retired_pending=False, remap_pending=False, remap_failed=False,
                    recovery_action=0)
    assert judge_reading(first, first) is None  # old errors from before the worker: the baseline
    assert judge_reading(Reading(), first) is None  # nothing supported: nothing to say
    cases = {
        "3 new uncorrected": Reading(ecc_uncorrected=5),
        "row remapping is pending": Reading(remap_pending=True),
        "row remapping failed": Reading(remap_failed=True),
        "page retirement is pending": Reading(retired_pending=True),
        "asks for a GPU reset": Reading(recovery_action=1),
    }
    for words, reading in cases.items():
        verdict = judge_reading(reading, first)
        assert verdict is not None and verdict.action is Action.DRAIN and words in verdict.reason, (words, verdict)


def test_a_device_failure_stop_makes_a_device_failed_ending_unless_the_job_finished_ok() -> None:
    stop = StopJob(job_id="j", reason=StopReason.DEVICE_FAILED, message="gpu0 failed (Xid 79)")
    assert STOPS[StopReason.DEVICE_FAILED] == (DeviceFailed, Outcome.DEVICE_FAILED)
    crashed = Ended.by_worker(RuntimeError, "died", pid=1, retired=None)
    assert crashed.under(stop).outcome is Outcome.DEVICE_FAILED
    ok = Ended(outcome=Outcome.OK, finished=None, error=None, error_module=None, pid=1, retired=None)
    assert ok.under(stop).outcome is Outcome.OK
    # Never a job's own saying: without the worker's stop it is an error.
    own = Ended(outcome=Outcome.DEVICE_FAILED, finished=None, error=None, error_module=None, pid=1, retired=None)
    assert own.under(None).outcome is Outcome.ERROR


def test_sent_by_name_is_the_devices_own_queue_at_any_level() -> None:
    def request(queue: str | None) -> Any:
        return SimpleNamespace(delivery_info={"routing_key": queue} if queue else {})

    assert sent_by_name(request("device.gpu0"), "gpu0")
    assert sent_by_name(request("device.gpu0:urgent"), "gpu0")
    assert sent_by_name(request("device.gpu0:batch~alice"), "gpu0")
    assert not sent_by_name(request("gpu"), "gpu0")
    assert not sent_by_name(request("sweep.abc"), "gpu0")
    assert not sent_by_name(request("device.gpu01"), "gpu0")
    assert not sent_by_name(request(None), "gpu0")


def test_the_watchdog_gives_up_on_a_hung_call_and_refuses_the_next_at_once() -> None:
    release = threading.Event()
    caller = NvmlCaller(timeout_s=0.2)
    assert caller.call("quick", lambda: 7) == 7
    with pytest.raises(NvmlHung, match="hung_call did not return within 0.2 s"):
        caller.call("hung_call", release.wait, 30)
    refused_at = time.monotonic()
    with pytest.raises(NvmlHung, match="has not returned yet"):
        caller.call("next", lambda: 1)
    assert time.monotonic() - refused_at < 0.2  # refused, not queued behind the hung call
    release.set()
    wait_for(lambda: _answers(caller), 5, "the NVML thread free again")
    caller.close()


def _answers(caller: NvmlCaller) -> bool:
    try:
        return bool(caller.call("again", lambda: 1) == 1)
    except NvmlHung:
        return False


# -- the service against the fake NVML and a real Redis -------------------------------------------


def test_a_fatal_xid_drains_the_device_with_its_reason_and_counts_it(client: Any, nvml: Any) -> None:
    nvml.scenario({"events": [{"at": 0.0, "xid": 13}, {"at": 0.1, "xid": 79}]})
    health = service(client, nvml)
    health.start()
    try:
        state = wait_for(lambda: (s := read_state(client, "gpu0")).state == "drained" and s, 20, "gpu0 drained")
    finally:
        health.stop()
    assert state.by == "health" and state.hardware and state.reason == "Xid 79: GPU has fallen off the bus"
    assert health.failed is not None and health.failed.xid == 79
    assert [v.xid for v in health.verdicts if v.xid] == [13, 79]
    assert client.hgetall(keys.XID_COUNTS) == {"gpu0:13": "1", "gpu0:79": "1"}


def test_an_applications_xid_leaves_the_device_in_service(client: Any, nvml: Any) -> None:
    nvml.scenario({"events": [{"at": 0.0, "xid": 31}]})
    health = service(client, nvml, uuid="GPU-not-known-to-nvml")  # NVML's index then
    health.start()
    try:
        wait_for(lambda: client.hget(keys.XID_COUNTS, "gpu0:31"), 20, "Xid 31 counted")
    finally:
        health.stop()
    assert read_state(client, "gpu0").state == "ok" and health.failed is None
    assert nvml.calls[:3] == ["nvmlInit", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByIndex"]


def test_a_failing_nvml_call_makes_the_device_suspect_and_not_supported_does_not(client: Any, nvml: Any) -> None:
    nvml.scenario({"fail": {"nvmlDeviceGetRemappedRows": "NotSupported", "nvmlDeviceGetTotalEccErrors": "Unknown"}})
    health = service(client, nvml)
    health.start()
    try:
        state = wait_for(lambda: (s := read_state(client, "gpu0")).state == "suspect" and s, 20, "gpu0 suspect")
    finally:
        health.stop()
    assert "nvmlDeviceGetTotalEccErrors failed" in state.reason and state.by == "health"
    assert not any("RemappedRows" in v.reason for v in health.verdicts)
    assert health.failed is None  # suspect: no new work, but the running job goes on


def test_the_recovery_action_is_read_where_nvidia_ml_py_lacks_its_name(client: Any, nvml: Any) -> None:
    # nvidia-ml-py 12.535.133, pyproject's floor, has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: the
    # field is asked for by its number (before: AttributeError ended the health thread at once).
    del nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    health = service(client, nvml)
    health.start()
    try:
        wait_for(lambda: "nvmlDeviceGetFieldValues" in nvml.calls, 20, "the first reading")
        nvml._scenario.setdefault("counters", {})["recovery_action"] = 1
        state = wait_for(lambda: (s := read_state(client, "gpu0")).state == "drained" and s, 20, "gpu0 drained")
    finally:
        health.stop()
    assert "asks for a GPU reset" in state.reason and health.watching.is_set()


def test_a_verdict_never_lowers_the_state(client: Any, nvml: Any) -> None:
    write_state(client, DeviceState(device="gpu0", state="drained", reason="by hand", by="alice", since=1.0))
    health = service(client, nvml)
    health.judge(Verdict(Action.SUSPECT, "NVML nvmlInit failed: Unknown"))
    assert read_state(client, "gpu0").reason == "by hand"


def test_a_hung_nvml_call_makes_the_device_suspect_while_heartbeat_and_leases_go_on(client: Any, nvml: Any) -> None:
    nvml.scenario({"hang": {"nvmlDeviceGetTotalEccErrors": 30}})
    beats: list[float] = []
    renewals: list[float] = []

    class Recorded(Heartbeat):
        def tick(self) -> None:
            super().tick()
            beats.append(time.monotonic())

    class RecordedLeases(LeaseKeeper):
        def tick(self) -> None:
            super().tick()
            renewals.append(time.monotonic())

    heartbeat = Recorded(client, WorkerRecord(
        device="gpu0", kind="gpu", worker="gpu0@host", host="host", pid=1, queues=["gpu"], cores=[0],
        pool="threads", jobs=[], started_at=time.time()), 0.05, 10.0)
    leases = RecordedLeases(client, "gpu0", "gpu0@host", ttl_s=0.15)  # a renewal round every 0.05 s
    health = service(client, nvml, timeout_s=1.0)
    heartbeat.start()
    leases.start()
    health.start()
    try:
        wait_for(lambda: "nvmlDeviceGetTotalEccErrors" in nvml.calls, 20, "the ECC read sent")
        hung_at = time.monotonic()
        state = wait_for(lambda: (s := read_state(client, "gpu0")).state == "suspect" and s, 20, "gpu0 suspect")
        suspect_at = time.monotonic()
    finally:
        health.stop()
        leases.stop()
        heartbeat.stop()
    assert "nvmlDeviceGetTotalEccErrors did not return within 1 s" in state.reason
    # Neither the heartbeat nor the lease keeper waited on the hung call: each went on all
    # through the watchdog's wait, no gap between its rounds anywhere near the watchdog's timeout.
    for name, times in (("heartbeat", beats), ("lease renewals", renewals)):
        during = [t for t in times if hung_at <= t <= suspect_at]
        assert len(during) >= 3, (name, len(during), suspect_at - hung_at)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) < health.caller.timeout_s / 2, (name, max(gaps))


def test_the_exporter_serves_xid_counts_per_device(client: Any, redis_server: Any) -> None:
    count_xid(client, "gpu0", 79)
    count_xid(client, "gpu0", 79)
    count_xid(client, "gpu1@hostb", 13)
    assert read_xid_counts(client) == {"gpu0": {79: 2}, "gpu1@hostb": {13: 1}}
    collector = FleetCollector(redis_server.url)
    try:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for metric in collector.collect() for s in metric.samples}
    finally:
        collector.close()
    assert samples[("devicefleet_device_xid_total", (("device", "gpu0"), ("xid", "79")))] == 2
    assert samples[("devicefleet_device_xid_total", (("device", "gpu1@hostb"), ("xid", "13")))] == 1


# -- a real worker with the fake NVML --------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_fatal_xid_mid_job_hands_the_job_to_another_device_as_no_attempt(fleet: Any, app: Any,
                                                                           tmp_path: Path) -> None:
    """cpu9 watches a (fake) GPU: Xid 79 while its job runs. The job goes back to the shared
    queue with no attempt spent and runs again on cpu0; cpu9 is drained naming Xid 79, takes
    nothing more, and a fan-out naming it afterwards is refused with the drain's reason."""
    import sys

    from tasks.core.job import task_name
    from tasks.core.registry import connect, live_workers

    from .conftest import standalone_worker, worker_configs

    queue = "health-test"
    trigger, marker = tmp_path / "xid-now", tmp_path / "runs"
    marker.mkdir()
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"trigger": str(trigger), "events": [{"at": 0.3, "xid": 79}]}))
    configs = worker_configs(tmp_path / "configs", health_nvml_index=0, extra_queues=[queue])
    argv = [sys.executable, "-m", "tasks", "worker", "cpu9"]
    client = connect(fleet.redis_url)
    cpu0 = live_workers(client)["cpu0"].worker
    with standalone_worker(fleet, "cpu9", argv, tmp_path / "cpu9.log", DEVICEFLEET_WORKER_CONFIGS_DIR=str(configs),
                           DEVICEFLEET_STATE_DIR=str(tmp_path / "state"), DEVICEFLEET_FAKE_NVML=str(scenario),
                           PYTHONPATH=f"{FAKE_NVML.parent}:{test_env()['PYTHONPATH']}") as (_, record):
        try:
            result = app.send_task(task_name("counted"), queue=queue,
                                   kwargs={"marker": str(marker), "seconds": 4.0, "steps": 40})
            runs = marker / result.id
            wait_for(lambda: runs.exists() and runs.read_text().split(), 60, "the job to start on cpu9")
            trigger.touch()
            state = wait_for(lambda: (s := read_state(client, "cpu9")).state == "drained" and s, 30, "cpu9 drained")
            # Now a healthy device consumes the shared queue too: the job goes there.
            app.control.add_consumer(queue, destination=[cpu0], reply=True, timeout=10)
            entry = result.get(timeout=90)
        finally:
            app.control.cancel_consumer(queue, destination=[cpu0], reply=True, timeout=10)
        assert entry["device"] == "cpu0" and entry["status"] == "ok", entry
        # From the drain (Redis' clock) to the run on cpu0 (this host's clock), including the
        # round trip that made cpu0 consume the queue: no lease had to expire first.
        handoff_s = datetime.fromisoformat(entry["started_at"]).timestamp() - state.since
        print(f"HEALTH job ran again on cpu0 {handoff_s:.2f} s after cpu9 was drained "
              f"(lease TTL {fleet.settings.lease_ttl_s:g} s)")
        assert handoff_s < fleet.settings.lease_ttl_s + 1
        assert len(runs.read_text().split()) == 2  # stopped on cpu9, then run in full on cpu0
        assert client.llen(keys.worker_deaths(result.id)) == 0  # no attempt spent
        assert state.reason == "Xid 79: GPU has fallen off the bus" and state.by == "health" and state.hardware
        assert read_xid_counts(client).get("cpu9") == {79: 1}
        # Named afterwards: the fan-out is refused at once, naming the drain's reason.
        from tasks.core.errors import DeviceUnavailable
        from tasks.producer.fanout import fan_out

        with pytest.raises(DeviceUnavailable, match="Xid 79"):
            fan_out(("counted", {"marker": str(marker)}), ["cpu9"], app=app)
        # A queue it is asked to consume later (a new sweep's): it takes nothing from it, as a
        # drained device takes nothing (one owner, tasks.worker.service); cpu0 runs the job.
        cpu9, later = record.worker, "health-test-later"
        app.control.add_consumer(later, destination=[cpu9], reply=True, timeout=10)
        bounced = app.send_task(task_name("counted"), queue=later, kwargs={"marker": str(marker)})
        try:
            app.control.add_consumer(later, destination=[cpu0], reply=True, timeout=10)
            assert bounced.get(timeout=60)["device"] == "cpu0"
        finally:
            app.control.cancel_consumer(later, destination=[cpu0], reply=True, timeout=10)
        assert (marker / bounced.id).read_text().count("\n") == 1  # never run on cpu9
    client.close()


# -- the real NVML on a GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_an_illegal_address_kernel_is_an_applications_xid_watched_only(client: Any) -> None:
    """A kernel that stores to an unmapped address (tests/scripts/illegal_address.py): the real
    NVML delivers its Xid (31, or 13), which is counted and watched; the GPU stays in service."""
    import subprocess
    import sys

    import pynvml

    health = HealthService(client, "gpu0", pynvml, 0, event_wait_s=0.2, poll_s=1.0)
    health.start()
    try:
        wait_for(lambda: health.watching.is_set() or not health._thread.is_alive(), 30,
                 "NVML asked for its events")
        if health._events is None:
            pytest.skip(f"NVML gives no Xid events here: {[v.reason for v in health.verdicts]}")
        script = Path(__file__).parent / "scripts" / "illegal_address.py"
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        counts = wait_for(lambda: read_xid_counts(client).get("gpu0"), 30, "the fault's Xid")
    finally:
        health.stop()
    assert set(counts) <= {13, 31, 43, 45}, counts
    assert read_state(client, "gpu0").state == "ok" and health.failed is None
    assert all(v.action is Action.WATCH for v in health.verdicts), health.verdicts
