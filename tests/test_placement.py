"""Placement by what a device is (issue 50, item 4): :mod:`tasks.core.placement`'s constraints
in process, then against the session fleet, whose CPU devices carry different labels
(``conftest.FLEET_LABELS``: cpu0 ``rack=a``, cpu1 ``rack=b, nvlink=true``), and beside it two
more CPU workers that say they are GPUs of two models (``tests/fake_device``)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from typing import Any

import psutil
import pytest
from rich.console import Console

import tasks
from tasks.core import keys
from tasks.core.device_state import DeviceState, write_state
from tasks.core.errors import ConfigError, GroupUnavailable, PlacementUnavailable
from tasks.core.groups import GroupChoice
from tasks.core.placement import GIB, Constraints, device_memory, parse_requirements, place
from tasks.core.queue_lists import QueueLists
from tasks.core.queues import device_queue, sweep_queue
from tasks.core.records import JobOptions, SlotRecord, WorkerRecord
from tasks.core.registry import connect, live_workers
from tasks.ops.status import render, report
from tasks.producer.connections import Connections
from tasks.producer.fanout import JobSpec, gang_spec, group_job

from .conftest import FLEET_LABELS, cli_env, wait_for

RACK_B = {"labels": {"rack": "b"}}


def _record(device: str, **fields: Any) -> WorkerRecord:
    values: dict[str, Any] = {"device": device, "kind": "gpu", "worker": f"{device}@h", "host": "h", "pid": 1,
                              "queues": [], "cores": [0], "pool": "threads", "jobs": [], "started_at": 0.0}
    values.update(fields)
    return WorkerRecord(**values)


H100 = _record("gpu0", device_name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB, compute_capability="9.0",
               labels={"nvlink": True, "rack": "a"})
T4 = _record("gpu1", device_name="Tesla T4", total_memory=16 * GIB, compute_capability="7.5", host="h2")
CPU = _record("cpu0", kind="cpu", device_name="Intel Xeon", slots=[SlotRecord(index=0, cores=[0], budget_bytes=8 * GIB)])


# -- the record, in process -----------------------------------------------------------------------


def test_constraints_match_what_a_device_is_and_say_what_it_lacks():
    big = Constraints.parse({"min_memory_gib": 40, "gpu_model": "h100", "min_compute_capability": 8,
                             "labels": {"nvlink": True}})
    assert big is not None and big.min_compute_capability == "8.0"
    assert big.matches(H100) and big.why_not(H100) == ""
    assert not big.matches(T4)
    assert big.unmet(T4) == ["model is Tesla T4, not h100", "memory 16.0 GiB < 40 GiB",
                             "compute capability 7.5 < 8.0", "label nvlink is unset, not true"]
    # A CPU device's memory is its slots' budgets; it has no compute capability.
    assert Constraints(min_memory_gib=8).matches(CPU) and not Constraints(min_memory_gib=9).matches(CPU)
    assert Constraints(min_compute_capability="7.0").why_not(CPU) == "compute capability none < 7.0"
    assert Constraints(kind="cpu").matches(CPU) and not Constraints(kind="cpu").matches(H100)
    assert Constraints(host="h2").matches(T4) and not Constraints(host="h2").matches(H100)
    # A label's value is compared with its type: true is not 1, "a" is not "A".
    assert not Constraints(labels={"nvlink": 1}).matches(H100)
    assert Constraints(labels={"rack": "a"}).matches(H100) and not Constraints(labels={"rack": "A"}).matches(H100)
    # Compute capabilities compare as numbers, not text.
    assert Constraints(min_compute_capability="10.0").why_not(H100) == "compute capability 9.0 < 10.0"


def test_no_constraint_is_none_and_they_travel_in_the_options():
    assert Constraints.parse(None) is None and Constraints.parse({}) is None and Constraints.parse(Constraints()) is None
    options = JobOptions(constraints=Constraints(min_memory_gib=40, labels={"nvlink": True}))
    assert JobOptions.model_validate(options.to_dict()) == options


@pytest.mark.parametrize(("given", "named"), [
    ({"min_memroy_gib": 40}, "unknown constraint 'min_memroy_gib': did you mean 'min_memory_gib'?"),
    ({"colour": "red"}, "unknown constraint 'colour': known constraints: kind, gpu_model, min_memory_gib"),
    ({"min_memory_gib": -1}, "constraint min_memory_gib=-1"),
    ({"min_memory_gib": "lots"}, "constraint min_memory_gib='lots'"),
    ({"kind": "tpu"}, "constraint kind='tpu'"),
    ({"min_compute_capability": "eight"}, "constraint min_compute_capability='eight'"),
    ({"labels": {"nvlink": [1, 2]}}, "constraint labels.nvlink"),
])
def test_an_unknown_key_or_a_bad_value_is_one_line_naming_it(given, named):
    with pytest.raises(ConfigError) as caught:
        Constraints.parse(given)
    message = str(caught.value)
    assert named in message and "\n" not in message
    if "unknown" in named:
        assert "labels" in message and "host" in message  # every known key


def test_require_items_read_as_the_cli_gives_them():
    parsed = parse_requirements(["min_memory_gib=40", "label.nvlink=true", "label.rack=a", "gpu_model=4090",
                                 "kind=gpu"])
    assert parsed == Constraints(min_memory_gib=40, gpu_model="4090", kind="gpu", labels={"nvlink": True, "rack": "a"})
    assert parse_requirements([]) is None
    with pytest.raises(ConfigError, match="--require 'min_memory_gib': give KEY=VALUE"):
        parse_requirements(["min_memory_gib"])
    with pytest.raises(ConfigError, match="unknown constraint 'gpu': did you mean 'gpu_model'"):
        parse_requirements(["gpu=H100"])


def test_place_keeps_matching_devices_in_service_and_refuses_naming_the_closest():
    live = {"gpu0": H100, "gpu1": T4, "cpu0": CPU}
    chosen = ["cpu0", "gpu0", "gpu1"]
    assert place(chosen, live, None) == chosen
    assert place(chosen, live, Constraints(kind="gpu")) == ["gpu0", "gpu1"]
    assert place(chosen, live, Constraints(kind="gpu"), out_of_service=["gpu0"]) == ["gpu1"]
    with pytest.raises(PlacementUnavailable) as caught:
        place(chosen, live, Constraints(min_memory_gib=40), out_of_service=["gpu0"])
    message = str(caught.value)
    assert "min_memory_gib=40" in message and "gpu0: out of service" in message
    assert "gpu1: memory 16.0 GiB < 40 GiB" in message and "nothing was sent" in message
    assert caught.value.closest["gpu0"] == "out of service"


def test_a_refusal_names_the_devices_closest_to_the_amounts_asked_first():
    # Each lacks one thing; the nearer its amount to the one asked, the closer (a CPU has none).
    live = {"cpu0": CPU, "cpu9": CPU.model_copy(update={"device": "cpu9"}), "gpu1": T4, "gpu0": H100}
    for asked in (Constraints(min_compute_capability="9.5"), Constraints(min_memory_gib=100)):
        with pytest.raises(PlacementUnavailable) as caught:
            place(list(live), live, asked)
        assert list(caught.value.closest) == ["gpu0", "gpu1", "cpu0"], asked
    assert Constraints(min_compute_capability="8.6").shortfall(H100) == 0.0


def test_a_cpu_device_without_a_budget_offers_its_hosts_ram():
    host = _record("cpu1", kind="cpu", device_name="Intel Xeon", host_memory=32 * GIB,
                   slots=[SlotRecord(index=0, cores=[0], budget_bytes=None)])
    assert device_memory(host) == 32 * GIB and device_memory(CPU) == 8 * GIB  # a budget comes first
    assert Constraints(min_memory_gib=16).matches(host)
    assert Constraints(min_memory_gib=64).unmet(host) == ["memory 32.0 GiB < 64 GiB"]
    # A GPU's memory is its own, never its host's; a record from an older worker: unknown.
    assert device_memory(T4.model_copy(update={"host_memory": 512 * GIB})) == 16 * GIB
    assert Constraints(min_memory_gib=1).unmet(host.model_copy(update={"host_memory": None})) == \
        ["memory unknown < 1 GiB"]


def test_a_device_named_outright_must_match_and_is_never_dropped_quietly():
    live = {"gpu0": H100, "gpu1": T4, "cpu0": CPU}
    assert place(["gpu0", "gpu1"], live, Constraints(kind="gpu"), named=["gpu0", "gpu1"]) == ["gpu0", "gpu1"]
    with pytest.raises(PlacementUnavailable) as caught:
        place(["gpu0", "gpu1", "cpu0"], live, Constraints(min_memory_gib=40), named=["gpu1", "cpu0"])
    assert caught.value.closest == {"gpu1": "memory 16.0 GiB < 40 GiB", "cpu0": "memory 8.0 GiB < 40 GiB"}
    assert str(caught.value).startswith("gpu1, cpu0, named outright, do not meet the constraints min_memory_gib=40: ")
    with pytest.raises(PlacementUnavailable, match="^gpu0, named outright, does not meet .*gpu0: out of service"):
        place(["gpu0", "gpu1"], live, Constraints(kind="gpu"), out_of_service=["gpu0"], named=["gpu0"])


# -- the fleet ------------------------------------------------------------------------------------


def test_workers_register_their_labels(fleet):
    client = connect(fleet.redis_url)
    try:
        live = live_workers(client)
    finally:
        client.close()
    assert {device: live[device].labels for device in FLEET_LABELS} == FLEET_LABELS
    assert all(live[device].compute_capability is None for device in FLEET_LABELS)
    assert {live[device].host_memory for device in FLEET_LABELS} == {psutil.virtual_memory().total}


@pytest.mark.timeout(60)
def test_a_memory_constraint_places_cpu_devices_by_their_hosts_ram(fleet, app):
    # The session's CPU devices have one slot and no memory_gib: their host's RAM is what they offer.
    ram_gib = psutil.virtual_memory().total / GIB
    results = tasks.fan_out("echo", "cpu", kwargs={"value": 1}, constraints={"min_memory_gib": ram_gib / 2}, app=app)
    assert sorted(results.get(timeout=30)) == sorted(FLEET_LABELS)
    with pytest.raises(PlacementUnavailable, match=f"cpu0: memory {ram_gib:.1f} GiB < {2 * ram_gib:g} GiB"):
        tasks.fan_out("echo", "cpu", constraints={"min_memory_gib": 2 * ram_gib}, app=app)


@pytest.mark.timeout(90)
def test_a_constrained_sweep_runs_every_trial_only_on_the_matching_device(fleet, app):
    trials = [{"value": i} for i in range(12)]
    handle = tasks.sweep("echo", trials, "cpu", constraints=RACK_B, app=app)
    assert handle.devices == ["cpu1"] and handle.queue.queue == sweep_queue(handle.id)
    entries = handle.get(timeout=60)
    assert [e["status"] for e in entries] == ["ok"] * 12
    assert {e["device"] for e in entries} == {"cpu1"}
    assert {e["output"]["device"] for e in entries} == {"cpu1"}


@pytest.mark.timeout(60)
def test_a_constrained_fan_out_sends_only_to_matching_devices(fleet, app):
    handle = tasks.fan_out("echo", "cpu", kwargs={"value": 1}, constraints={"labels": {"nvlink": True}}, app=app)
    assert list(handle.get(timeout=30)) == ["cpu1"]
    with pytest.raises(PlacementUnavailable, match="cpu0: label nvlink is unset, not true"):
        tasks.fan_out({"cpu0": "echo"}, constraints={"labels": {"nvlink": True}}, app=app)


def _queued(client: Any, queues: list[str]) -> int:
    return sum(QueueLists.read(client, queue).count(client) for queue in queues)


@pytest.mark.timeout(60)
def test_an_impossible_constraint_is_refused_before_anything_is_sent(fleet, app):
    client = connect(fleet.redis_url)
    name = f"impossible-{uuid.uuid4().hex[:8]}"
    queues = ["fleet", "cpu", device_queue("cpu0"), device_queue("cpu1"), sweep_queue(name)]
    try:
        before = _queued(client, queues)
        with pytest.raises(PlacementUnavailable) as caught:
            tasks.sweep("echo", [{"value": 1}], "cpu", name=name, constraints={"labels": {"rack": "c"}}, app=app)
        message = str(caught.value)
        assert "label.rack=\"c\"" in message and "cpu0: label rack is \"a\", not \"c\"" in message
        assert "cpu1: label rack is \"b\", not \"c\"" in message
        with pytest.raises(PlacementUnavailable):
            tasks.fan_out("echo", "cpu", constraints={"min_memory_gib": 1 << 19}, app=app)
        with pytest.raises(PlacementUnavailable, match="kind=gpu"):
            tasks.start_study("echo", {"value": [1, 2]}, 2, "value", devices="cpu", constraints={"kind": "gpu"},
                              app=app)
        # A device out of service is not placed on: rack=b only on cpu1, which is drained.
        write_state(client, DeviceState(device="cpu1", state="drained", reason="test", by="test"))
        try:
            with pytest.raises(PlacementUnavailable, match="cpu1: out of service"):
                tasks.sweep("echo", [{"value": 1}], "cpu", constraints=RACK_B, app=app)
        finally:
            write_state(client, DeviceState(device="cpu1"))
        assert _queued(client, queues) == before
        assert client.get(keys.sweep(name)) is None
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_a_constrained_gang_and_group_land_only_on_matching_devices(fleet, app):
    # A gang over the cpu devices asking for nvlink: one rank, on cpu1 only.
    gang = tasks.fan_out("ranked", "cpu", kwargs={"steps": 1}, distributed=True,
                         constraints={"labels": {"nvlink": True}}, app=app)
    rank = gang.plan["cpu1"].options
    assert list(gang.plan) == ["cpu1"] and rank.gang is not None and rank.gang.devices == ["cpu1"]
    assert rank.constraints == Constraints(labels={"nvlink": True})
    entry = gang.get(timeout=60)["cpu1"]
    assert entry["status"] == "ok", entry["error"]
    assert entry["output"]["env"]["WORLD_SIZE"] == "1" and entry["output"]["sum"] == 1.0
    # A group asking what both devices are: both, in one group, with the constraints its leader checks.
    group = tasks.fan_out("group_probe", "cpu", group=2, constraints={"kind": "cpu"}, app=app)
    assert list(group.plan) == ["cpu0+cpu1"] and group.plan["cpu0+cpu1"].options.constraints == Constraints(kind="cpu")
    entry = group.get(timeout=60)["cpu0+cpu1"]
    assert entry["status"] == "ok", entry["error"]
    assert entry["output"]["devices"] == ["cpu0", "cpu1"]


def _reserved(client: Any) -> int:
    return sum(client.zcard(keys.device_claims(device)) for device in FLEET_LABELS)


@pytest.mark.timeout(60)
def test_a_gang_or_group_no_set_of_devices_meets_is_refused_naming_the_constraint(fleet, app):
    client = connect(fleet.redis_url)
    queues = ["fleet", "cpu", device_queue("cpu0"), device_queue("cpu1")]
    try:
        before, reserved = _queued(client, queues), _reserved(client)
        with pytest.raises(PlacementUnavailable, match='label.rack="c".*cpu0: label rack is "a", not "c"'):
            tasks.fan_out("ranked", "cpu", distributed=True, constraints={"labels": {"rack": "c"}}, app=app)
        # A gang that names its ranks, in a mapping or a list: each must match (its world size is
        # what the caller named, never quietly less).
        with pytest.raises(PlacementUnavailable, match='cpu0: label rack is "a", not "b"'):
            tasks.fan_out({"cpu0": "ranked", "cpu1": "ranked"}, distributed=True, constraints=RACK_B, app=app)
        with pytest.raises(PlacementUnavailable, match='^cpu0, named outright, does not meet .*cpu0: label rack is "a"'):
            tasks.fan_out("ranked", ["cpu0", "cpu1"], distributed=True, constraints=RACK_B, app=app)
        with pytest.raises(PlacementUnavailable, match="^cpu0, named outright"):
            tasks.sweep("echo", [{"value": 1}], "cpu0,cpu1", constraints=RACK_B, app=app)
        # A group of 2 where only cpu1 is rack=b: no set of devices makes it.
        with pytest.raises(PlacementUnavailable) as caught:
            tasks.fan_out("group_probe", "cpu", group=2, constraints=RACK_B, app=app)
        message = str(caught.value)
        assert 'label.rack="b" for a group of 2 devices of one kind on one host' in message
        assert caught.value.closest == {
            "cpu1": f"meets them; matching cpu devices on {tasks.live_devices(app)['cpu1'].host}: 1 of the 2 "
                    "a group needs",
            "cpu0": 'label rack is "a", not "b"'}
        with pytest.raises(PlacementUnavailable, match='cpu0: label rack is "a", not "b"'):
            tasks.fan_out({"cpu0+cpu1": "group_probe"}, constraints=RACK_B, app=app)
        with pytest.raises(PlacementUnavailable, match="for a group of 2"):
            tasks.sweep("group_probe", [{}], "cpu", group=2, constraints=RACK_B, app=app)
        # Without constraints, a group no host can give is still GroupUnavailable.
        with pytest.raises(GroupUnavailable):
            tasks.fan_out("group_probe", "cpu1", group=2, app=app)
        assert (_queued(client, queues), _reserved(client)) == (before, reserved)
    finally:
        client.close()


def test_status_shows_each_devices_labels_in_its_table_and_json(fleet):
    rep = report(fleet.redis_url)
    assert {device: rep["devices"][device]["labels"] for device in FLEET_LABELS} == FLEET_LABELS
    assert json.loads(json.dumps(rep))["devices"]["cpu1"]["labels"] == {"rack": "b", "nvlink": True}
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(rep))
    lines = console.export_text().splitlines()
    assert any('labels: rack="a"' in line for line in lines if line.startswith("cpu0: "))
    assert any('labels: nvlink=true, rack="b"' in line for line in lines if line.startswith("cpu1: "))


@pytest.mark.timeout(60)
def test_a_worker_never_runs_a_job_its_device_does_not_match(fleet, app):
    # Sent past the producer's check (as if cpu0 changed since): by name, an entry says why;
    # from a shared queue, cpu0 hands it back and only cpu1 runs it.
    spec = JobSpec.of("echo", {"value": 1}, {"constraints": RACK_B})
    named = spec.signature(app, device_queue("cpu0")).apply_async()
    with pytest.raises(Exception, match="cpu0 does not meet the job's constraints label.rack=\"b\"") as caught:
        named.get(timeout=30)
    assert type(caught.value).__name__ == "DeviceMismatch"
    shared = [spec.signature(app, "cpu").apply_async() for _ in range(6)]
    assert {result.get(timeout=40)["device"] for result in shared} == {"cpu1"}


@pytest.mark.timeout(60)
def test_a_gang_rank_its_device_does_not_match_fails_its_gang_at_once(fleet, app):
    # Ranks sent past the producer's check (as if cpu0 changed since): cpu0 refuses its rank and
    # fails the gang, so cpu1's rank ends naming it, long before its 600 s join timeout.
    client = connect(fleet.redis_url)
    try:
        live = live_workers(client)
        spec = JobSpec.of("ranked", {"steps": 1}, {"constraints": RACK_B})
        plan = {"cpu0": spec, "cpu1": spec}
        gang = gang_spec(plan, live, {"join_timeout_s": 600}, seq=int(client.incr(keys.CLAIM_SEQ)))
        ranked = spec.model_copy(update={"options": spec.options.model_copy(update={"gang": gang})})
        sent = {device: ranked.signature(app, device_queue(device)).apply_async() for device in plan}
        errors = {}
        for device, result in sent.items():
            with pytest.raises(Exception) as caught:  # noqa: PT011 (each rank's own type, checked below)
                result.get(timeout=40)
            errors[device] = (type(caught.value).__name__, str(caught.value))
        assert errors["cpu0"][0] == "DeviceMismatch"
        assert errors["cpu1"][0] == "GangFailed", errors
        assert 'rank 0 on cpu0 was refused: cpu0 does not meet the job\'s constraints label.rack="b"' in errors["cpu1"][1]
        assert client.ttl(keys.gang(gang.id)) > 0
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_group_whose_member_does_not_match_never_runs_and_lets_its_devices_go(fleet, app):
    # A group sent past the producer's check (as if cpu1 changed since): its leader, cpu0, meets
    # rack=a; its member cpu1 does not. The leader refuses it naming cpu1 and lets the devices go.
    client = connect(fleet.redis_url)
    try:
        before = _reserved(client)
        spec = JobSpec.of("group_probe", {}, {"constraints": {"labels": {"rack": "a"}}})
        sent = group_job(spec, GroupChoice(["cpu0", "cpu1"], "test"), Connections.of(app), app)
        result = sent.signature(app, device_queue("cpu0")).apply_async()
        with pytest.raises(Exception, match='cpu1: label rack is "b", not "a"; it did not run') as caught:
            result.get(timeout=40)
        assert type(caught.value).__name__ == "DeviceMismatch"
        assert _reserved(client) == before
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_the_cli_refuses_a_bad_requirement_in_one_line(fleet):
    out = subprocess.run([sys.executable, "-m", "tasks", "run", "echo", "--require", "min_memroy_gib=4",
                          "--redis-url", fleet.redis_url], capture_output=True, text=True, env=cli_env(), timeout=50)
    assert out.returncode != 0 and out.stdout == ""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "did you mean 'min_memory_gib'" in lines[0], out.stderr


@pytest.mark.timeout(90)
def test_a_placed_trial_waits_for_its_busy_device_and_waiting_says_what_it_asks(fleet, app, tmp_path):
    release = tmp_path / "release"
    hold = tasks.fan_out("hold", ["cpu1"], kwargs={"steps": 1, "release_file": str(release)},
                         options={"preemptible": False}, app=app)
    try:
        wait_for(lambda: hold.progress()["cpu1"].get("step") == 1, 60, "the hold job running on cpu1")
        # What waiting() says cpu1 runs is its registry record's, once its heartbeat wrote the busy slot.
        wait_for(lambda: tasks.live_devices(app)["cpu1"].running, 30, "cpu1's record showing the hold job")
        handle = tasks.sweep("echo", [{"value": 1}], "cpu", constraints=RACK_B, app=app)
        mine = wait_for(lambda: [job for job in tasks.waiting(app) if job.job_id in handle.task_ids], 30,
                        "the trial listed as waiting")
        assert mine[0].devices == ["cpu1"] and mine[0].constraints == 'label.rack="b"'
        assert mine[0].reason.startswith('it asks for a device with label.rack="b": ')
        assert "every device that can take it is busy (cpu1: hold" in mine[0].reason
    finally:
        release.touch()
    assert hold.get(timeout=30)["cpu1"]["status"] == "ok"
    assert [entry["device"] for entry in handle.get(timeout=30)] == ["cpu1"]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_gpu_worker_registers_its_model_memory_and_compute_capability_and_is_placed_by_them(fleet, app):
    import torch

    gpus = {d: r for d, r in tasks.live_devices(app).items() if r.kind == "gpu"}
    assert "gpu0" in gpus, "a GPU host runs a GPU worker"
    device, record = "gpu0", gpus["gpu0"]
    major, minor = torch.cuda.get_device_capability(0)
    assert record.compute_capability == f"{major}.{minor}"
    assert record.total_memory and record.device_name == torch.cuda.get_device_name(0)
    exact = {"gpu_model": record.device_name, "min_compute_capability": record.compute_capability,
             "min_memory_gib": record.total_memory // GIB}
    assert device in tasks.fan_out("noop", "all", constraints=exact, app=app).get(timeout=60)
    with pytest.raises(PlacementUnavailable, match=f"{device}: memory"):
        tasks.fan_out("noop", "gpu", constraints={"min_memory_gib": record.total_memory / GIB + 1}, app=app)


SIMULATED = {"cpu4": {"device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"},
             "cpu5": {"device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}}


@pytest.mark.timeout(240)
def test_a_sweep_constrained_by_gpu_model_or_capability_runs_only_on_the_devices_that_are_it(fleet, app, tmp_path):
    """A mixed fleet of simulated GPUs on this CPU machine (tests/fake_device): two more CPU
    workers saying they are an A100 (8.0) and an H100 (9.0) beside the session's cpu0 and cpu1
    (this CPU, no compute capability). Each constraint's trials run only where it matches; a
    capability none meets is refused naming each device's."""
    from contextlib import ExitStack

    from .conftest import ROOT, standalone_worker, test_env

    fake = ROOT / "tests" / "fake_device"
    with ExitStack() as stack:
        for device, attributes in SIMULATED.items():
            argv = [sys.executable, "-m", "tasks", "worker", device]
            _, record = stack.enter_context(standalone_worker(
                fleet, device, argv, tmp_path / f"{device}.log", DEVICEFLEET_STATE_DIR=str(tmp_path / device),
                FAKE_DEVICE_ATTRIBUTES=json.dumps(attributes),
                PYTHONPATH=f"{fake}:{test_env()['PYTHONPATH']}"))
            assert (record.device_name, record.compute_capability) == tuple(attributes.values())
        cases = [({"gpu_model": "H100"}, {"cpu5"}), ({"gpu_model": "a100"}, {"cpu4"}),
                 ({"min_compute_capability": "8.0"}, {"cpu4", "cpu5"}),
                 ({"min_compute_capability": "8.6"}, {"cpu5"})]
        handles = [(tasks.sweep("echo", [{"value": i} for i in range(8)], "cpu", constraints=asked, app=app),
                    asked, devices) for asked, devices in cases]
        for handle, asked, devices in handles:
            assert set(handle.devices) == devices, asked
            entries = handle.get(timeout=120)
            assert [e["status"] for e in entries] == ["ok"] * 8, asked
            assert {e["device"] for e in entries} <= devices, (asked, entries)
        with pytest.raises(PlacementUnavailable) as caught:
            tasks.sweep("echo", [{"value": 1}], "cpu", constraints={"min_compute_capability": "9.5"}, app=app)
        assert caught.value.closest == {"cpu5": "compute capability 9.0 < 9.5", "cpu4": "compute capability 8.0 < 9.5",
                                        "cpu0": "compute capability none < 9.5"}  # the closest first
        assert str(caught.value).startswith("no live device meets the constraints min_compute_capability=9.5")
