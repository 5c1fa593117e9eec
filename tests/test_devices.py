"""Devices out of service (issue 50): drained by hand, their state kept, obeyed by the worker and
by fan-outs; against the session fleet (cpu0 + cpu1), the module's own Redis for the state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tasks
from tasks.core import keys
from tasks.core.device_state import DeviceState, out_of_service, read_state, redis_now, write_state
from tasks.core.errors import DeviceUnavailable, UnknownDevice
from tasks.core.jobcount import JOBS_ERROR, JOBS_OK
from tasks.core.records import LeaseRecord
from tasks.core.registry import connect
from tasks.ops.devices_admin import drain, listing, undrain
from tasks.ops.exporter import FleetCollector, fleet_snapshot
from tasks.ops.status import health_text
from tasks.producer.fanout import select_devices

from .conftest import cli_env, wait_for

CLI = [sys.executable, "-m", "tasks"]


def _done(client, device: str) -> int:  # type: ignore[no-untyped-def]
    stats = client.hgetall(keys.stats(device))
    return int(stats.get(JOBS_OK, 0)) + int(stats.get(JOBS_ERROR, 0))


def _holds_a_lease(client, device: str) -> bool:  # type: ignore[no-untyped-def]
    return any(LeaseRecord.model_validate_json(raw).device == device for raw in client.hvals(keys.LEASES))


@pytest.mark.timeout(120)
def test_a_drained_device_takes_no_job_of_a_busy_sweep_and_comes_back_on_undrain(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    trials = [{"marker": str(tmp_path), "score": float(i), "seconds": 0.05} for i in range(40)]
    try:
        handle = tasks.sweep("counted", trials, devices="cpu0,cpu1", app=app)
        before = _done(client, "cpu1")
        wait_for(lambda: _done(client, "cpu1") > before, 30, "cpu1 to run a trial of the sweep")
        state = drain(client, "cpu1", "test: maintenance", by="tester")
        assert state.by == "tester" and state.state == "drained"
        # Its running trial finishes (its lease goes with its stored end); then nothing more.
        wait_for(lambda: not _holds_a_lease(client, "cpu1"), 30, "cpu1's running trial to end")
        done_when_drained = _done(client, "cpu1")
        entries = handle.get(timeout=90)
        assert len(entries) == len(trials)
        assert [entry["error"] for entry in entries if entry["error"] is not None] == []
        assert _done(client, "cpu1") == done_when_drained, "a drained device took a trial"
        assert live_ok(client, "cpu1"), "a drained device keeps its heartbeat"
        # status's health column and the exporter's gauge say so.
        health = fleet_snapshot(client)["devices"]["cpu1"]["health"]
        assert (health["state"], health["reason"], health["by"]) == ("drained", "test: maintenance", "tester")
        assert "drained" in health_text(health) and "tester" in health_text(health)
        gauges = {tuple(sample.labels.values()): sample.value for family in FleetCollector(fleet.redis_url).collect()
                  if family.name == "devicefleet_device_state" for sample in family.samples}
        assert gauges[("cpu1", "cpu", "drained")] == 1 and gauges[("cpu1", "cpu", "ok")] == 0
        assert gauges[("cpu0", "cpu", "ok")] == 1
        # A fan-out treats it as missing: refused before anything is sent, naming why.
        with pytest.raises(DeviceUnavailable, match=r"cpu1 \(drained: test: maintenance, by tester\)"):
            tasks.fan_out("noop", devices="cpu1", app=app)
        assert tasks.fan_out("noop", devices="all", app=app).get(timeout=30).keys() == {"cpu0"}
        assert undrain(client, "cpu1").in_service
        assert tasks.fan_out("noop", devices="cpu1", app=app).get(timeout=30)["cpu1"]["error"] is None
    finally:
        write_state(client, DeviceState(device="cpu1"))


def live_ok(client, device: str) -> bool:  # type: ignore[no-untyped-def]
    from tasks.core.registry import live_workers

    return device in live_workers(client)


@pytest.mark.timeout(60)
def test_drain_now_hands_the_running_job_back_without_spending_an_attempt(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    try:
        # Long enough to be running when drained (it stops at its next progress call); its run again is short.
        handle = tasks.fan_out("counted", devices="cpu1", kwargs={"marker": str(tmp_path), "seconds": 6.0,
                                                                  "steps": 60}, app=app)
        wait_for(lambda: _holds_a_lease(client, "cpu1"), 30, "the job to start on cpu1")
        drain(client, "cpu1", "test: now", now=True, by="tester")
        # Handed back to cpu1's own queue (its lease released): it waits there while cpu1 is drained.
        wait_for(lambda: not _holds_a_lease(client, "cpu1"), 30, "the running job to be handed back")
        undrain(client, "cpu1")
        entry = handle.get(timeout=60)["cpu1"]
        assert entry["error"] is None
        runs = [len(path.read_text().splitlines()) for path in Path(tmp_path).iterdir()]
        assert runs == [2], "it ran again after it was handed back"
    finally:
        write_state(client, DeviceState(device="cpu1"))


@pytest.mark.timeout(60)
def test_device_cli_refuses_an_unknown_device_and_undraining_one_in_service(fleet):
    env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url)
    drained = subprocess.run([*CLI, "device", "drain", "gpu9", "--reason", "x"], env=env, capture_output=True,
                             text=True, timeout=30)
    assert drained.returncode == 2
    assert "gpu9" in drained.stderr and "known devices: cpu0, cpu1" in drained.stderr
    assert len(drained.stderr.strip().splitlines()) == 1
    undrained = subprocess.run([*CLI, "device", "undrain", "cpu0"], env=env, capture_output=True, text=True,
                               timeout=30)
    assert undrained.returncode == 2 and "not out of service" in undrained.stderr
    rows = {row["device"]: row for row in listing(connect(fleet.redis_url))}  # what `device list --json` prints
    assert rows["cpu0"]["state"] == "ok" and rows["cpu0"]["live"]


def test_the_state_survives_a_redis_restart(redis_server, client):
    write_state(client, DeviceState(device="gpu3", state="drained", reason="fan", by="ops", since=redis_now(client)))
    redis_server.stop()
    redis_server.start()
    again = connect(redis_server.url)
    state = read_state(again, "gpu3")
    assert (state.state, state.reason, state.by) == ("drained", "fan", "ops")


def test_a_device_out_of_service_counts_as_missing(client):
    from .test_units import _record

    live = {name: _record(name) for name in ("cpu0", "cpu1")}
    write_state(client, DeviceState(device="cpu1", state="quarantined", reason="black hole", by="fleet"))
    out = out_of_service(client, ["cpu0", "cpu1"])
    assert set(out) == {"cpu1"}
    assert select_devices("all", live, out) == ["cpu0"]
    with pytest.raises(DeviceUnavailable, match=r"cpu1 \(quarantined: black hole, by fleet\)"):
        select_devices("cpu0,cpu1", live, out)
    with pytest.raises(UnknownDevice, match="device 'cpu7'.*known devices: cpu1"):
        drain(client, "cpu7", "x")
    assert [row["device"] for row in listing(client)] == ["cpu1"]


def _clear_blackhole_state(client) -> None:  # type: ignore[no-untyped-def]
    for device in ("cpu0", "cpu1"):
        write_state(client, DeviceState(device=device))
        client.delete(keys.fast_failures(device), keys.fast_failure_errors(device))


def _runs(marker: Path) -> dict[str, list[str]]:
    return {path.name: path.read_text().split() for path in marker.iterdir()}


@pytest.mark.timeout(120)
def test_a_black_hole_is_quarantined_after_k_fast_failures_and_every_trial_ends_ok(fleet, app, tmp_path):
    from tasks.core.defaults import BLACKHOLE_K

    client = connect(fleet.redis_url)
    _clear_blackhole_state(client)
    # Each good run takes 0.25 s, so cpu0 needs about 5 s for them all: time for cpu1 to take
    # K jobs even on a loaded machine (at 0.02 s each, cpu0 once ran all 30 before cpu1 had
    # taken 3 under a second pytest worker, and nothing was quarantined).
    trials = [{"marker": str(tmp_path), "bad_device": "cpu1", "seconds": 0.25, "score": float(i)} for i in range(20)]
    try:
        entries = tasks.sweep("blackhole", trials, devices="cpu0,cpu1", app=app).get(timeout=100)
        assert [entry["error"] for entry in entries] == [None] * len(trials)
        assert {entry["device"] for entry in entries} == {"cpu0"}
        state = read_state(client, "cpu1")
        assert (state.state, state.by) == ("quarantined", "fleet")
        assert "black hole" in state.reason and "RuntimeError: device cpu1 fails every job" in state.reason
        runs = _runs(tmp_path)
        failed_on_cpu1 = [job for job, devices in runs.items() if "cpu1" in devices]
        # Quarantined at its K-th different failing job (a job it had already taken then may fail too).
        assert BLACKHOLE_K <= len(failed_on_cpu1) <= BLACKHOLE_K + 2
        assert all(devices.count("cpu1") <= 1 for devices in runs.values()), "a job ran twice on the black hole"
        assert not set(runs) & set(client.hkeys(keys.DEAD_LETTERS)), "a trial was dead-lettered"
    finally:
        _clear_blackhole_state(client)


@pytest.mark.timeout(120)
def test_a_job_failing_everywhere_is_its_own_fault_and_quarantines_nothing(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    _clear_blackhole_state(client)
    trials = [{"marker": str(tmp_path), "bad_device": "*", "score": float(i)} for i in range(6)]
    try:
        entries = tasks.sweep("blackhole", trials, devices="cpu0,cpu1", app=app).get(timeout=100)
        assert [entry["error"]["type"] for entry in entries] == ["RuntimeError"] * len(trials)
        assert out_of_service(client, ["cpu0", "cpu1"]) == {}
        # Each ran at most twice (its first fast failure on a device is given back once).
        assert all(1 <= len(devices) <= 2 for devices in _runs(tmp_path).values())
    finally:
        _clear_blackhole_state(client)


@pytest.mark.timeout(90)
def test_undraining_a_hardware_drain_runs_the_probe_job_first(fleet, app):
    client = connect(fleet.redis_url)
    try:
        write_state(client, DeviceState(device="cpu1", state="drained", reason="Xid 79", by="health", hardware=True,
                                        since=redis_now(client)))
        before = _done(client, "cpu1")
        assert undrain(client, "cpu1", app=app).in_service
        assert _done(client, "cpu1") == before + 1, "the probe job did not run on cpu1"
    finally:
        write_state(client, DeviceState(device="cpu1"))


def test_a_record_from_a_newer_worker_is_read_without_its_new_fields(client, caplog):
    """A rolling upgrade starts the new workers first: their records carry fields this version
    does not know, and their devices must not vanish from its registry (they did: a record
    that failed to parse was dropped as malformed). One that is malformed otherwise still is."""
    import json
    import logging

    from tasks.core.records import SlotRecord, WorkerRecord
    from tasks.core.registry import live_workers

    record = WorkerRecord(device="cpu0", kind="cpu", worker="cpu0@h", host="h", pid=1, queues=["cpu"],
                          cores=[0], pool="threads", jobs=["echo"], started_at=0.0,
                          slots=[SlotRecord(index=0, cores=[0], budget_bytes=None)])
    newer = json.loads(record.model_dump_json())
    newer["power_watts"] = 300
    newer["slots"][0]["mig_profile"] = "1g.10gb"
    broken = {**newer, "pid": "not a pid"}
    for device, data in (("cpu0", newer), ("cpu1", {**broken, "device": "cpu1"})):
        client.sadd(keys.WORKERS, device)
        client.set(keys.worker(device), json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="tasks.core.registry"):
        live = live_workers(client)
    assert list(live) == ["cpu0"] and live["cpu0"] == record
    assert "registry record of cpu1 is malformed" in caplog.text and "cpu0" not in caplog.text


def test_a_drain_stored_by_a_newer_version_is_still_obeyed(client):
    """The same for the other records the fleet stores (tasks.core.records.stored): a drain with
    a field this version does not know still takes the device out of service; before, reading
    it raised, and every read of the device states failed with it."""
    import json

    newer = {"device": "cpu0", "state": "drained", "reason": "fan noise", "since": 1.0, "by": "ops",
             "ticket": "INC-1"}
    client.hset(keys.DEVICE_STATE, "cpu0", json.dumps(newer))
    state = read_state(client, "cpu0")
    assert (state.state, state.reason, state.in_service) == ("drained", "fan noise", False)
    assert list(out_of_service(client, ["cpu0", "cpu1"])) == ["cpu0"]
