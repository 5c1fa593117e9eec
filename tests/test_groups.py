"""Device groups: one job over several devices of one host, in one job process
(tasks/worker/group.py, tasks/core/groups.py), on the session fleet's cpu0 and cpu1.

The pure parts (which devices, which GPUs by their links, the refusal) are unit tests; the
mechanism (reservation, holds, wait-die, the gate that stops new single jobs) is tested on the
real fleet, each test in a few seconds. A worker killed under a group is in
tests/test_reliability.py, whose fleet is supervised.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from rich.console import Console

import tasks
from tasks import fan_out
from tasks.cli import cli
from tasks.core import claims, keys
from tasks.core.devices import Device
from tasks.core.errors import ConfigError, GroupUnavailable
from tasks.core.group_reservation import reserve_at_send
from tasks.core.groups import Link, best_connected, group_budget, group_environment, plan_groups
from tasks.core.priority import Level, precedence
from tasks.core.records import SlotRecord, WorkerRecord
from tasks.core.wire import Outcome, ProcessSpec, RunJob
from tasks.ops.status import render, report
from tasks.producer.fanout import FanOut
from tasks.worker.group import GroupGate
from tasks.worker.group_host import GroupHostLink, _Leader
from tasks.worker.jobenv import job_environment
from tasks.worker.memory import ResidentMeter
from tasks.worker.supervisor import Apart, ProcessPolicy, Supervisor

from .conftest import ROOT, TEST_JOB_MODULES, wait_for
from .test_components import _RankWatch  # a watch that relays nothing and never stops the job


def _record(device: str, host: str, kind: str = "cpu", cores: list[int] | None = None) -> WorkerRecord:
    return WorkerRecord(device=device, kind=kind, worker=f"{device}@{host}", host=host, pid=1, queues=[],
                        cores=cores or [0], pool="threads", jobs=["train"], started_at=0.0)


# -- the pure part -------------------------------------------------------------------------------


def test_best_connected_prefers_nvlink_then_a_common_switch_on_a_fake_topology():
    """Four GPUs: 0-1 and 2-3 on NVLink, 1-2 on one PCIe switch, the rest across sockets."""
    nvlink = {frozenset({0, 1}), frozenset({2, 3})}
    switch = {frozenset({1, 2})}

    def link(a: int, b: int) -> Link:
        pair = frozenset({a, b})
        return Link.NVLINK if pair in nvlink else Link.PCIE_SWITCH if pair in switch else Link.SYSTEM

    assert best_connected([0, 1, 2, 3], 2, link) == ([0, 1], "gpu0+gpu1: every pair at best nvlink")
    assert best_connected([1, 2, 3], 2, link)[0] == [2, 3]
    assert best_connected([0, 1, 2], 2, link)[0] == [0, 1]
    assert best_connected([1, 2], 2, link) == ([1, 2], "gpu1+gpu2: every pair at best pcie switch")
    # Three of four: the set without a cross-socket pair does not exist; the fewest worst pairs win.
    chosen, why = best_connected([0, 1, 2, 3], 3, link)
    assert chosen == [0, 1, 2] and why.endswith("system")


def test_plan_groups_takes_one_host_and_kind_and_refuses_naming_each_host():
    live = {"cpu0": _record("cpu0", "a"), "cpu1": _record("cpu1", "a"), "gpu0": _record("gpu0", "a", "gpu"),
            "cpu0@b": _record("cpu0@b", "b"), "cpu1@b": _record("cpu1@b", "b"), "cpu2@b": _record("cpu2@b", "b")}
    assert plan_groups(list(live), live, 2) == [["cpu0", "cpu1"], ["cpu0@b", "cpu1@b"]]
    assert plan_groups(list(live), live, 3) == [["cpu0@b", "cpu1@b", "cpu2@b"]]
    with pytest.raises(GroupUnavailable) as refused:
        plan_groups(["cpu0", "gpu0", "cpu0@b"], live, 2)
    message = str(refused.value)
    assert "a has cpu0 (cpu), cpu1 (cpu), gpu0 (gpu)" in message
    assert "b has cpu0@b (cpu), cpu1@b (cpu), cpu2@b (cpu)" in message


def test_a_groups_memory_budget_is_the_sum_of_its_devices_budgets():
    gib = 1 << 30

    def budgeted(device: str, *budgets: int | None) -> WorkerRecord:
        slots = [SlotRecord(index=i, cores=[i], budget_bytes=b) for i, b in enumerate(budgets)]
        return _record(device, "a").model_copy(update={"slots": slots})

    # Each device's budget is all its slots' (the group has the whole device), summed over devices.
    assert group_budget([budgeted("cpu0", 2 * gib), budgeted("cpu1", gib, gib)]) == 4 * gib
    # Not enforced on one of them, or one not known: not enforced on the group.
    assert group_budget([budgeted("cpu0", 2 * gib), budgeted("cpu1", None)]) is None
    assert group_budget([budgeted("cpu0", 2 * gib), None]) is None
    assert group_budget([budgeted("cpu0", 2 * gib), _record("cpu1", "a")]) is None
    assert group_budget([]) is None


def test_group_environment_lists_gpus_in_bus_order():
    assert group_environment(["gpu3", "gpu1"]) == {"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert group_environment(["cpu0", "cpu1"]) == {"CUDA_VISIBLE_DEVICES": "-1"}


def _at_gate(gate: GroupGate, job_id: str, level: Level, give_up: threading.Event) -> tuple[threading.Thread, list[bool]]:
    """A single job of ``level`` coming to ``gate`` in a thread of its own; what it was told."""
    told: list[bool] = []

    def come() -> None:
        with gate.single(job_id, give_up.is_set, level) as admitted:
            told.append(admitted)

    thread = threading.Thread(target=come, daemon=True)
    thread.start()
    return thread, told


@pytest.mark.timeout(30)
def test_a_gate_closed_for_a_batch_group_admits_an_urgent_single_job_only():
    """Closed for a ``batch`` group, the gate lets an ``urgent`` single job in at once, the
    device's hold taken back first; a ``batch`` one waits (the group is not starved by singles
    of its own level), and so does an ``urgent`` one while a group runs on the device."""
    gate, group_runs = GroupGate(), threading.Event()
    taken_back: list[bool] = []
    gate.take_back = lambda: taken_back.append(not group_runs.is_set()) or not group_runs.is_set()
    gate.close("g.1", Level.BATCH)
    urgent, told = _at_gate(gate, "urgent", Level.URGENT, threading.Event())
    urgent.join(10)
    assert told == [True] and taken_back == [True]
    give_up = threading.Event()
    batch, batch_told = _at_gate(gate, "batch", Level.BATCH, give_up)
    wait_for(lambda: gate.held_back == 1, 10, "the batch job to wait at the gate")
    give_up.set()
    batch.join(10)
    assert batch_told == [False] and gate.held_back == 0
    group_runs.set()  # a group's run holds the device: an urgent job waits for it as any
    urgent, told = _at_gate(gate, "urgent-2", Level.URGENT, threading.Event())
    wait_for(lambda: gate.held_back == 1, 10, "the urgent job to wait for the group's run")
    assert taken_back == [True, False] and not told
    gate.open()
    urgent.join(10)
    assert told == [True]


# -- on the fleet ----------------------------------------------------------------------------------


@pytest.fixture
def rclient(fleet):  # type: ignore[no-untyped-def]
    c = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    yield c
    c.close()


def _free(client: redis.Redis, devices: list[str]) -> bool:
    """No reservation or hold left on ``devices``."""
    return all(client.zcard(keys.device_claims(d)) == 0 and client.get(keys.group_hold(d)) is None
               for d in devices)


@pytest.mark.timeout(120)
def test_a_group_job_sees_both_devices_cores_and_names(app, rclient):
    live = tasks.live_devices(app)
    results = fan_out("group_probe", "cpu", group=2, app=app).get(timeout=90)
    assert list(results) == ["cpu0+cpu1"]
    entry = results["cpu0+cpu1"]
    assert entry["status"] == "ok", entry["error"]
    assert entry["device"] == "cpu0+cpu1"
    out = entry["output"]
    cores = sorted({*live["cpu0"].cores, *live["cpu1"].cores})
    assert out["devices"] == ["cpu0", "cpu1"]
    assert out["cores"] == cores and out["affinity"] == cores and out["threads"] == len(cores)
    assert out["cuda_visible_devices"] == "-1"
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the group's reservations and holds to go")


@pytest.mark.timeout(60)
def test_a_group_no_host_can_give_is_refused_before_anything_is_sent(app):
    with pytest.raises(GroupUnavailable, match=r"has cpu0 \(cpu\), cpu1 \(cpu\)"):
        fan_out("group_probe", "cpu", group=3, app=app)
    with pytest.raises(GroupUnavailable):
        fan_out("group_probe", "cpu0", group=2, app=app)
    with pytest.raises(ConfigError, match="group=1"):
        fan_out("group_probe", "cpu", group=1, app=app)
    with pytest.raises(ConfigError, match="neither distributed"):
        fan_out("group_probe", "cpu", group=2, distributed=True, app=app)


@pytest.mark.timeout(120)
def test_a_cancelled_group_job_leaves_no_process_behind(app, rclient, tmp_path):
    pid_file = tmp_path / "child.pid"
    handle = fan_out("group_probe", "cpu", group=2, kwargs={"child_pid_file": str(pid_file)}, app=app)
    wait_for(pid_file.is_file, 60, "the group job to start its child")
    child = int(pid_file.read_text())
    handle.cancel()
    entry = handle.get(timeout=60)["cpu0+cpu1"]
    assert entry["status"] == "cancelled", entry
    wait_for(lambda: not _alive(child), 10, f"the job's child {child} to be ended")
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the group's reservations and holds to go")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # it may be reaped between the signal and the read: then it is gone
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not stat.split(") ", 1)[1].startswith("Z")


@pytest.mark.timeout(180)
def test_overlapping_groups_and_singles_all_finish_and_singles_wait_for_a_reserved_device(fleet, app, rclient, tmp_path):
    """cpu1 runs a single job; a group over cpu0+cpu1 reserves both and waits for it; single
    jobs sent to cpu1 after the reservation start only after the group has run (the reservation
    closed cpu1's gate: without it they would start as the first single ends, and a stream of
    them would starve the group). A second group over the same devices, led by cpu1, waits its
    turn (wait-die): all finish, and the two groups never run at once."""
    release, release_a = tmp_path / "release", tmp_path / "release-a"
    first = fan_out("hold", "cpu1", kwargs={"steps": 1, "release_file": str(release)}, app=app)
    wait_for(lambda: tasks.live_devices(app)["cpu1"].busy is not None, 60, "cpu1 to run the single job")
    group_a = fan_out({"cpu0+cpu1": ("group_probe", {"release_file": str(release_a)})}, app=app)
    group_b = fan_out({"cpu1+cpu0": ("group_probe", {})}, app=app)

    def waiting() -> bool:
        runs = [rclient.hgetall(keys.group_run(a)) for a in claims.groups_on(rclient, ["cpu1"])]
        return any(r.get("state") == "waiting" and "cpu1" in r.get("waiting_for", "") and "closed:cpu1" in r
                   for r in runs)

    wait_for(waiting, 30, "a group to wait for cpu1, closed to new single jobs")
    # `devicefleet status` shows the waiting group and what it waits for: cpu1's single job.
    shown = [g for g in report(fleet.redis_url)["groups"] if g["state"] == "waiting" and "cpu1" in g["waiting_for"]]
    assert shown and shown[0]["name"] in ("cpu0+cpu1", "cpu1+cpu0"), shown
    assert shown[0]["waiting_for"]["cpu1"].startswith(f"hold {first.task_ids['cpu1']}"), shown
    # Why it got its devices: the caller named them.
    assert shown[0]["why"] == f"{shown[0]['name']}: named by the caller", shown
    console = Console(width=200, record=True)
    console.print(render(report(fleet.redis_url)))
    shown_text = console.export_text()
    assert f"cpu1: hold {first.task_ids['cpu1']}" in shown_text
    assert "named by the caller" in shown_text
    singles = [fan_out("echo", "cpu1", kwargs={"value": i}, app=app) for i in range(3)]
    sent_at = time.time()
    release.touch()
    assert first.get(timeout=60)["cpu1"]["status"] == "ok"
    # Group A runs (until the test lets it end) while the first of the singles waits at cpu1's
    # closed gate: without the reservation it would run beside A.
    a_run = keys.group_run(claims.groups_on(rclient, ["cpu0"])[0])
    wait_for(lambda: rclient.hget(a_run, "state") == "running" and int(rclient.hget(a_run, "closed:cpu1") or 0) >= 1,
             30, "group A to run while a single job waits at cpu1's gate")
    release_a.touch()
    a = group_a.get(timeout=90)["cpu0+cpu1"]
    b = group_b.get(timeout=90)["cpu1+cpu0"]
    assert a["status"] == "ok" and b["status"] == "ok", (a, b)
    # The jobs' own clocks, read in their processes: a group's job ends before it lets its
    # devices go, so these spans are ordered whatever the load.
    spans = sorted([(a["output"]["started"], a["output"]["ended"]), (b["output"]["started"], b["output"]["ended"])])
    assert spans[0][1] <= spans[1][0], f"the two groups ran at once: {spans}"
    for handle in singles:
        entry = handle.get(timeout=90)["cpu1"]
        assert entry["status"] == "ok", entry
        # Sent while a group reserved cpu1: it started after that group had run.
        assert datetime.fromisoformat(entry["started_at"]).timestamp() >= spans[0][1], (entry, spans, sent_at)
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the groups' reservations and holds to go")


def _busy(app: Any, device: str, release: Path) -> FanOut:
    """A single job that holds ``device`` until ``release`` exists, once it runs there."""
    handle = fan_out("hold", device, kwargs={"steps": 1, "release_file": str(release)}, app=app)
    wait_for(lambda: tasks.live_devices(app)[device].busy is not None, 60, f"{device} to run the single job")
    return handle


def _started(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(entry["started_at"]).timestamp()


@pytest.mark.timeout(120)
def test_a_group_reserves_its_devices_as_it_is_sent_no_single_sent_after_it_starts_first(app, rclient, tmp_path,
                                                                                          monkeypatch):
    """cpu0 (the leader) and cpu1 each run a single job; a group over both is sent, then a
    single job to each. cpu1's job ends first, while the leader still runs its own: the single
    sent to cpu1 after the group waits at cpu1's gate, closed as the group was sent, and starts
    after the group has run. (Were the devices reserved only when the leader takes the group's
    message, cpu1 would start that single at once and the group would wait for it too.)"""
    monkeypatch.setattr("tasks.producer.fanout.GROUP_CLAIM_TTL_S", 120.0)  # no expiry under any load
    release0, release1 = tmp_path / "release0", tmp_path / "release1"
    busy0, busy1 = _busy(app, "cpu0", release0), _busy(app, "cpu1", release1)
    group = fan_out("group_probe", "cpu", group=2, app=app)
    spec = group.plan["cpu0+cpu1"].options.group
    assert spec is not None and spec.reservation is not None
    run = keys.group_run(spec.reservation)
    # Reserved by the producer, on cpu1 only: the leader's queue is first in, first out.
    assert rclient.hget(run, "state") == "sent"
    assert claims.groups_on(rclient, ["cpu1"]) == [spec.reservation]
    assert claims.groups_on(rclient, ["cpu0"]) == []  # its claim there closes no gate: it is queued there
    assert rclient.zrange(keys.device_claims("cpu0"), 0, -1) == [f"sent:{spec.reservation}"]
    after = {device: fan_out("echo", device, kwargs={"value": 1}, app=app) for device in ("cpu1", "cpu0")}
    release1.touch()
    assert busy1.get(timeout=60)["cpu1"]["status"] == "ok"
    wait_for(lambda: int(rclient.hget(run, "closed:cpu1") or 0) >= 1, 30,
             "the single sent after the group to wait at cpu1's closed gate")
    assert rclient.hget(run, "state") == "sent"  # the leader still runs its own job
    release0.touch()
    assert busy0.get(timeout=60)["cpu0"]["status"] == "ok"
    entry = group.get(timeout=90)["cpu0+cpu1"]
    assert entry["status"] == "ok", entry
    for device, handle in after.items():
        single = handle.get(timeout=90)[device]
        assert single["status"] == "ok", single
        assert _started(single) >= entry["output"]["ended"], (device, single, entry)
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the group's reservations and holds to go")


@pytest.mark.timeout(120)
def test_an_urgent_single_job_starts_before_a_batch_group_that_reserved_its_device(app, rclient, tmp_path,
                                                                                  monkeypatch):
    """A ``batch`` group over cpu1+cpu0 waits for cpu1's job, cpu0 reserved and held for it;
    an ``urgent`` single job sent to cpu0 then starts at once, before the group (one wait-die
    precedence: level first); a ``batch`` single sent after it waits for the group, as before."""
    monkeypatch.setattr("tasks.producer.fanout.GROUP_CLAIM_TTL_S", 120.0)  # no expiry under any load
    release = tmp_path / "release"
    busy = _busy(app, "cpu1", release)
    group = fan_out({"cpu1+cpu0": ("group_probe", {})}, priority="batch", app=app)
    spec = group.plan["cpu1+cpu0"].options.group
    assert spec is not None and spec.reservation is not None
    run = keys.group_run(spec.reservation)
    wait_for(lambda: rclient.get(keys.group_hold("cpu0")) == spec.reservation, 30,
             "cpu0, idle, to be held for the batch group")
    assert rclient.hget(run, "level") == "batch"
    urgent = fan_out("echo", "cpu0", kwargs={"value": 1}, priority="urgent", app=app).get(timeout=60)["cpu0"]
    assert urgent["status"] == "ok", urgent
    assert busy.states() == {"cpu1": "PROGRESS"}  # the group still waits for cpu1
    later = fan_out("echo", "cpu0", kwargs={"value": 2}, priority="batch", app=app)
    wait_for(lambda: int(rclient.hget(run, "closed:cpu0") or 0) >= 1, 30,
             "the batch single job to wait at cpu0's gate, held for the group again")
    release.touch()
    assert busy.get(timeout=60)["cpu1"]["status"] == "ok"
    entry = group.get(timeout=90)["cpu1+cpu0"]
    assert entry["status"] == "ok", entry
    assert _started(urgent) < _started(entry), (urgent, entry)
    single = later.get(timeout=90)["cpu0"]
    assert single["status"] == "ok", single
    assert _started(single) >= entry["output"]["ended"], (single, entry)
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the group's reservations and holds to go")


@pytest.mark.timeout(120)
def test_a_group_cancelled_before_its_leader_takes_it_lets_its_reservation_go(app, rclient, tmp_path):
    """The group waits in its leader's queue behind a single job; cancelling it lets cpu1,
    reserved as it was sent, take single jobs again at once, while the leader is still busy."""
    release = tmp_path / "release"
    busy = _busy(app, "cpu0", release)
    group = fan_out("group_probe", "cpu", group=2, app=app)
    spec = group.plan["cpu0+cpu1"].options.group
    assert spec is not None and spec.reservation is not None
    run = keys.group_run(spec.reservation)
    wait_for(lambda: rclient.hexists(run, "closed:cpu1"), 30, "cpu1's gate to close for the group")
    group.cancel()
    assert not rclient.exists(run) and rclient.zcard(keys.device_claims("cpu1")) == 0
    single = fan_out("echo", "cpu1", kwargs={"value": 1}, app=app).get(timeout=60)["cpu1"]
    assert single["status"] == "ok", single
    assert busy.states() == {"cpu0": "PROGRESS"}  # cpu1 ran it while the leader was still busy
    release.touch()
    assert busy.get(timeout=60)["cpu0"]["status"] == "ok"
    assert group.get(timeout=60)["cpu0+cpu1"]["status"] == "cancelled"
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the group's reservations and holds to go")


@pytest.mark.timeout(30)
def test_one_give_way_rule_orders_gangs_and_groups_by_level_then_age_and_skips_dead_claims(rclient):
    """The rule of tasks.core.claims on two devices no worker has: a waiter gives way to the first
    live claim before its own precedence on the devices it looks at, a gang's or a group's alike;
    a higher level goes first whatever the ages, an older claim first at the same level, and a
    claim whose ``alive`` key is gone (a dead worker's) counts for nothing and is dropped."""
    d0, d1 = "rule-d0", "rule-d1"

    def claim(kind: claims.Kind, claim_id: str, level: Level, seq: int, *devices: str, alive: bool = True) -> claims.Claim:
        made = claims.Claim(kind, claim_id, precedence(level, seq))
        for device in devices:
            rclient.zadd(keys.device_claims(device), {made.member: made.precedence})
        if alive:
            rclient.set(made.alive, 1, px=60_000)
        return made

    old_gang = claim(claims.GANG, "old-gang", Level.NORMAL, 10, d0)
    young_group = claim(claims.GROUP, "young-group", Level.NORMAL, 11, d0, d1)
    claim(claims.GROUP, "dead-group", Level.NORMAL, 1, d1, alive=False)
    urgent_gang = claim(claims.GANG, "urgent-gang", Level.URGENT, 12, d1)
    batch_group = claim(claims.GROUP, "batch-group", Level.BATCH, 2, d0)

    def gives_way_to(devices: list[str], level: Level, seq: int) -> tuple[str, claims.Claim] | None:
        pipe = rclient.pipeline(transaction=False)
        for device in devices:
            claims.read_before(pipe, device, precedence(level, seq))
        return claims.before(rclient, zip(devices, pipe.execute(), strict=True))

    try:
        # The young group looks at both its devices: the urgent gang goes first, whatever its age.
        assert gives_way_to([d0, d1], Level.NORMAL, 11) == (d1, urgent_gang)
        # On d0 alone it gives way to the older gang of its level, not to the older batch group.
        assert gives_way_to([d0], Level.NORMAL, 11) == (d0, old_gang)
        assert gives_way_to([d0], Level.NORMAL, 10) is None  # the oldest normal claim waits for nobody
        assert gives_way_to([d0], Level.BATCH, 3) == (d0, old_gang)  # any normal work goes before batch
        assert gives_way_to([d0], Level.BATCH, 2) == (d0, old_gang)
        assert gives_way_to([d0], Level.BATCH, 1) == (d0, old_gang)
        assert gives_way_to([d0], Level.URGENT, 1) is None
        # The dead group, older than all, is no reason to give way (a normal gang of seq 5 on d1
        # gives way to the urgent gang only).
        assert gives_way_to([d1], Level.NORMAL, 5) == (d1, urgent_gang)
        assert gives_way_to([d1], Level.NORMAL, 0) == (d1, urgent_gang)
        # A device's live claims, first in precedence first; the dead one is dropped from the set.
        entries = rclient.zrange(keys.device_claims(d1), 0, -1, withscores=True)
        assert claims.live(rclient, d1, entries) == [urgent_gang, young_group]
        assert rclient.zscore(keys.device_claims(d1), claims.member(claims.GROUP, "dead-group")) is None
        assert claims.groups_on(rclient, [d0, d1]) == ["young-group", "batch-group"]
        assert batch_group.level is Level.BATCH and str(old_gang) == "old-gang" and str(young_group) == "group young-group"
    finally:
        rclient.delete(keys.device_claims(d0), keys.device_claims(d1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("older", ["gang", "group"])
def test_a_gang_and_a_group_that_want_the_same_two_devices_both_end_the_older_first(app, rclient, tmp_path,
                                                                                     monkeypatch, older):
    """cpu1 runs a single job while a gang over cpu0,cpu1 and a group over cpu0+cpu1 are sent one
    after the other, both of the same level: one rule orders them (tasks.core.claims), the older
    first, and both end.

    Gang first: its rank 0 takes cpu0 and claims cpu1 for the gang; the group, sent next, claims
    cpu1 too, its message queued on cpu0 behind rank 0. The gang's claim comes first on cpu1, so
    cpu1's gate lets rank 1 in once the single job ends (a gate closed for the group would hold
    it back while rank 0 holds the group's leader's device: neither could start until the gang's
    join timeout failed it). Group first: its leader takes cpu0 and waits for cpu1; the gang's
    ranks wait behind it (queued on cpu0, at cpu1's gate, closed for the group)."""
    monkeypatch.setattr("tasks.producer.fanout.GROUP_CLAIM_TTL_S", 120.0)  # no expiry under any load
    release = tmp_path / "release"
    busy = _busy(app, "cpu1", release)

    def kinds_on_cpu1() -> list[str]:
        return [member.partition(":")[0] for member in rclient.zrange(keys.device_claims("cpu1"), 0, -1)]

    def send_gang() -> FanOut:
        return fan_out("ranked", "cpu0,cpu1", kwargs={"steps": 1}, distributed=True, app=app)

    def group_waits() -> bool:
        found = claims.groups_on(rclient, ["cpu1"])
        return bool(found) and rclient.hget(keys.group_run(found[0]), "state") == "waiting"

    if older == "gang":
        gang = send_gang()
        wait_for(lambda: kinds_on_cpu1() == ["gang"], 30, "rank 0 to join on cpu0 and claim cpu1 for its gang")
        group = fan_out({"cpu0+cpu1": ("group_probe", {})}, app=app)
        assert kinds_on_cpu1() == ["gang", "group"]  # both want cpu1, the gang first
    else:
        group = fan_out({"cpu0+cpu1": ("group_probe", {})}, app=app)
        wait_for(group_waits, 30, "the group's leader to take cpu0 and wait for cpu1")
        gang = send_gang()
        assert kinds_on_cpu1() == ["group"]  # the gang's ranks wait behind it, claiming nothing
    release.touch()
    busy.get(timeout=60)
    ranks = gang.get(timeout=90)
    group_entry = group.get(timeout=90)["cpu0+cpu1"]
    assert {d: e["status"] for d, e in ranks.items()} == {"cpu0": "ok", "cpu1": "ok"}, ranks
    assert group_entry["status"] == "ok", group_entry["error"]
    group_ran = (group_entry["output"]["started"], group_entry["output"]["ended"])  # its job process's clock
    if older == "gang":  # every rank had ended before the group's job started
        ended = max(datetime.fromisoformat(e["finished_at"]).timestamp() for e in ranks.values())
        assert ended <= group_ran[0], (ended, group_ran)
    else:  # the group's job had ended before any rank started
        started = min(_started(e) for e in ranks.values())
        assert group_ran[1] <= started, (group_ran, started)
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the claims and holds to go")


@pytest.mark.timeout(90)
def test_a_running_group_keeps_its_device_when_a_gang_claims_it_first(app, rclient, tmp_path):
    """A gang's claim first on cpu1 (an urgent gang's, written here as its joined rank writes
    it) opens cpu1's gate to its rank, but not while a group runs there: a group that has started
    never gives way, so a single job sent to cpu1 meanwhile waits at the gate for the group's end."""
    release_group, release_single = tmp_path / "group", tmp_path / "single"
    group = fan_out({"cpu0+cpu1": ("group_probe", {"release_file": str(release_group)})}, app=app)

    def running() -> str | None:
        found = claims.groups_on(rclient, ["cpu1"])
        return found[0] if found and rclient.hget(keys.group_run(found[0]), "state") == "running" else None

    attempt = wait_for(running, 30, "the group to run")
    gang = claims.Claim(claims.GANG, "urgent-gang", precedence(Level.URGENT, 0))
    rclient.set(gang.alive, 1, px=60_000)
    rclient.zadd(keys.device_claims("cpu1"), {gang.member: gang.precedence})
    try:
        claims.nudge(rclient, "cpu1")
        single = fan_out("hold", "cpu1", kwargs={"steps": 1, "release_file": str(release_single)}, app=app)
        wait_for(lambda: rclient.hget(keys.group_run(attempt), "closed:cpu1") == "1", 30,
                 "the single job to wait at cpu1's gate, shut for the running group")
    finally:
        rclient.zrem(keys.device_claims("cpu1"), gang.member)
        rclient.delete(gang.alive)
        release_group.touch()
        release_single.touch()
    ended = group.get(timeout=60)["cpu0+cpu1"]["output"]["ended"]
    entry = single.get(timeout=60)["cpu1"]
    assert entry["status"] == "ok", entry["error"]
    assert ended <= _started(entry), (ended, entry["started_at"])
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the claims and holds to go")


@pytest.mark.timeout(60)
def test_a_reservation_whose_group_was_never_sent_expires(app, rclient):
    """A producer that died between reserving a group and sending it: nobody claims the
    reservation; it expires after its TTL, and cpu1's keeper drops it and takes single jobs."""
    pipe = rclient.pipeline(transaction=False)
    reserve_at_send(pipe, "abandoned", ["cpu0", "cpu1"], "abandoned.0", ttl_s=1.0)
    pipe.execute()
    assert claims.groups_on(rclient, ["cpu1"]) == ["abandoned.0"]
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 30, "the abandoned reservation to be dropped")
    single = fan_out("echo", "cpu1", kwargs={"value": 1}, app=app).get(timeout=60)["cpu1"]
    assert single["status"] == "ok", single


@pytest.mark.timeout(120)
def test_a_sweep_and_a_study_with_group_run_each_trial_over_both_devices(fleet, app, rclient):
    """A sweep of 3 short trials with group=2 on cpu0+cpu1: each trial ran in one process over
    both devices, one trial at a time, its entry named by the group; a study's trials too
    (`devicefleet optimize --group 2`)."""
    live = tasks.live_devices(app)
    assert live["cpu0"].gpu_links is None and live["cpu1"].gpu_links is None  # CPU workers publish no links
    cores = sorted({*live["cpu0"].cores, *live["cpu1"].cores})
    with pytest.raises(GroupUnavailable, match=r"has cpu0 \(cpu\), cpu1 \(cpu\)"):
        tasks.sweep("group_probe", [{}], "cpu", group=3, app=app)
    with pytest.raises(ConfigError, match="group=1"):
        tasks.sweep("group_probe", [{}], "cpu", group=1, app=app)
    handle = tasks.sweep("group_probe", [{"timeout_s": 60.0 + i} for i in range(3)], "cpu", group=2, app=app)
    assert handle.devices == ["cpu0+cpu1"]
    entries = handle.get(timeout=90)
    assert [e["trial"] for e in entries] == [0, 1, 2]
    for entry in entries:
        assert entry["status"] == "ok" and entry["device"] == "cpu0+cpu1", entry
        assert entry["output"]["devices"] == ["cpu0", "cpu1"] and entry["output"]["affinity"] == cores, entry
    spans = sorted((e["output"]["started"], e["output"]["ended"]) for e in entries)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), f"two trials' groups ran at once: {spans}"
    assert handle.summary().devices == {"cpu0+cpu1": {"done": 3, "running": 0}}

    result = CliRunner().invoke(cli, ["optimize", "group_probe", "--space", '{"timeout_s": {"low": 30, "high": 60}}',
                                      "--trials", "2", "--objective", "threads", "--devices", "cpu", "--group", "2",
                                      "--json", "--redis-url", fleet.redis_url])
    assert result.exit_code == 0, result.output
    trials = json.loads(result.output)["trials"]
    assert len(trials) == 2, trials
    for trial in trials:
        assert trial["status"] == "complete" and trial["objective"] == len(cores), trial
        assert trial["device"] == "cpu0+cpu1", trial
    wait_for(lambda: _free(rclient, ["cpu0", "cpu1"]), 10, "the trials' reservations and holds to go")


@pytest.mark.timeout(120)
def test_devicefleet_run_group_prints_the_groups_entry(fleet):
    result = CliRunner().invoke(cli, ["run", "group_probe", "--devices", "cpu", "--group", "2", "--json",
                                      "--redis-url", fleet.redis_url])
    assert result.exit_code == 0, result.output
    entry = json.loads(result.output)["cpu0+cpu1"]
    assert entry["status"] == "ok" and entry["output"]["devices"] == ["cpu0", "cpu1"]
    refused = CliRunner().invoke(cli, ["run", "group_probe", "--group", "3", "--redis-url", fleet.redis_url])
    assert refused.exit_code != 0 and "no live host can run a group of 3" in refused.output


def _supervisor(tmp_path: Path) -> Supervisor:
    spec = ProcessSpec(device="cpu0", torch_device="cpu", cores=[0], torch_threads=1, job_modules=TEST_JOB_MODULES,
                       artifacts_dir=str(tmp_path / "artifacts"), tensorboard_dir=str(tmp_path / "tb"),
                       result_expires_s=60)
    return Supervisor(spec, job_environment(Device.parse("cpu0"), 1, []), ROOT, ProcessPolicy(), label="cpu0")


def _group_job(job_id: str, **kwargs: Any) -> RunJob:
    cores = sorted(os.sched_getaffinity(0))
    return RunJob(job_id=job_id, job="group_probe", kwargs=kwargs, fan_out_id=job_id, devices=["cpu0", "cpu1"],
                  cores=cores, torch_threads=len(cores))


@pytest.mark.timeout(120)
def test_a_group_whose_visibility_differs_runs_in_a_process_of_its_own(tmp_path):
    """The GPU groups' path, run here with a visibility no CPU worker has: the group's job gets a
    job process started with the group's environment and cores, ended after its job."""
    supervisor = _supervisor(tmp_path)
    group_env = {"CUDA_VISIBLE_DEVICES": ""}
    assert supervisor.needs_own_process(group_env)
    assert not supervisor.needs_own_process(group_environment(["cpu0", "cpu1"]))
    cores = sorted(os.sched_getaffinity(0))
    ended = supervisor.run(_group_job("apart"), _RankWatch(), apart=Apart(group_env))
    assert ended.outcome is Outcome.OK and ended.finished is not None, ended.error
    out = ended.finished.output
    assert out is not None
    assert out["cuda_visible_devices"] == "" and out["devices"] == ["cpu0", "cpu1"]
    assert out["affinity"] == cores and out["threads"] == len(cores)
    assert not _alive(int(out["pid"]))  # ended with its job
    assert supervisor.pids == []


@pytest.fixture
def group_host(tmp_path: Path) -> Iterator[tuple[GroupHostLink, subprocess.Popen[bytes]]]:
    """A leader's listening socket, as systemd passes it to a GPU worker, and the group host
    (``python -m tasks.worker.group_host``) connected to it, as devicefleet-groups.service runs it."""
    path = tmp_path / "gpu0.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen()
    link = GroupHostLink(listener, "cpu0")
    host = subprocess.Popen([sys.executable, "-m", "tasks.worker.group_host", str(path)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(lambda: link.connected, 30, "the group host to connect to the leader's socket")
        yield link, host
    finally:
        link.close()
        host.terminate()
        host.wait(10)
        listener.close()


@pytest.mark.timeout(60)
def test_a_group_host_that_reconnects_at_once_is_taken_and_a_closed_link_leaves_nothing_open(tmp_path):
    """A group host connecting again while the leader's reader still ends its old connection
    (which it closes) is taken without an error in the accepting thread, every time; and
    ``close`` stops listening and ends every connection (no thread left, no socket left open)
    but leaves the listening socket, systemd's, to the worker's next start."""
    path = str(tmp_path / "gpu0.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    link = GroupHostLink(listener, "cpu0")
    hosts: list[socket.socket] = []
    try:
        for i in range(42):
            if 0 < i < 41:
                hosts[-1].close()  # the old host's end goes as the new one connects
            hosts.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            hosts[-1].settimeout(10)
            hosts[-1].connect(path)
        # The last host kept the one before it open: the leader ends that one once it takes the last.
        assert hosts[-2].recv(16) == b""
        link.close()
        threads = [t for t in threading.enumerate() if t.name.startswith("devicefleet-group-host")]
        assert threads == []
        assert hosts[-1].recv(16) == b""  # the leader's end of the last connection is gone
        # The listening socket is systemd's: the worker's next start takes a host on it again.
        again = GroupHostLink(listener, "cpu0")
        hosts.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
        hosts[-1].connect(path)
        wait_for(lambda: again.connected, 10, "the next link to take a host on the same socket")
        again.close()
    finally:
        for host in hosts:
            host.close()
        listener.close()


@pytest.mark.timeout(30)
def test_a_group_host_whose_leader_goes_before_its_answer_serves_it_again():
    """The leader's connection closing before the host's answer to a spawn could go (the worker
    died meanwhile) ends that connection's service, so the host connects again: it does not
    end the thread that serves that leader."""
    host_end, leader_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    leader_end.send(json.dumps({"op": "spawn", "id": 0, "env": "not a mapping", "cwd": "/"}).encode())
    leader_end.close()
    try:
        _Leader("gpu0.sock")._serve(host_end)  # returns: the run loop closes it and connects again
    finally:
        host_end.close()


@pytest.mark.timeout(120)
def test_a_group_job_process_started_by_the_group_host_runs_and_ends_with_its_leader(tmp_path, group_host):
    """Under systemd a GPU group's job process is the group host's child (its unit opens the
    group's GPUs, tests/test_systemd.py): the leader runs the job in it as in its own, and a
    process the host started for a leader whose connection closes (the worker died) ends."""
    link, host = group_host
    supervisor = _supervisor(tmp_path)
    supervisor.group_host = link
    ended = supervisor.run(_group_job("hosted"), _RankWatch(), apart=Apart({"CUDA_VISIBLE_DEVICES": ""}))
    assert ended.outcome is Outcome.OK and ended.finished is not None, ended.error
    out = ended.finished.output
    assert out is not None
    assert out["ppid"] == host.pid and out["cuda_visible_devices"] == "" and out["devices"] == ["cpu0", "cpu1"]
    assert not _alive(int(out["pid"])) and supervisor.pids == []
    # A process started for this leader, then the leader's end of the connection gone.
    child, channel = link.spawn({**os.environ, "PYTHONPATH": str(ROOT)}, ROOT, 30)
    assert _alive(child.pid)
    link.disconnect()
    assert child.wait(30) == -signal.SIGKILL
    wait_for(lambda: not _alive(child.pid), 30, "the host to end the leader's job process")
    channel.close()
    assert child.stdout is not None
    child.stdout.close()


@pytest.mark.timeout(120)
def test_a_group_job_past_its_groups_memory_budget_ends_as_out_of_memory(tmp_path):
    """The group's budget (the sum of its devices', as the leader's worker computes it) is
    enforced on its job process as a slot's is: here 1 MiB, which a job process holding torch
    is far past at the first sample; its process ends and the error names the group."""
    supervisor = _supervisor(tmp_path)
    supervisor.meter = ResidentMeter()
    job = _group_job("over", release_file=str(tmp_path / "never"), timeout_s=100)
    ended = supervisor.run(job, _RankWatch(), apart=Apart({"CUDA_VISIBLE_DEVICES": ""}, budget_bytes=1 << 20))
    assert ended.outcome is Outcome.ERROR and ended.error is not None and ended.error.type == "OutOfMemory", ended
    assert "past group cpu0+cpu1's budget of 1 MiB" in ended.error.message
    assert ended.error.memory is not None and ended.error.memory["budget_mib"] == 1.0
    assert not _alive(ended.pid) and supervisor.pids == []
