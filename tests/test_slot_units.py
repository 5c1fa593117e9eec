"""Slots in-process: the plan of cores and budgets, the slot table, the memory meters, the
worker config's settings and the MPS daemon's control (with a stand-in control program)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.core.devices import Device, DeviceKind
from tasks.core.errors import ConfigError, FleetError
from tasks.core.queues import key_device, slot_key
from tasks.core.worker_config import WorkerConfig, load_worker_config
from tasks.worker.memory import DeviceMeter, ResidentMeter, open_meter
from tasks.worker.mps import MpsServer
from tasks.worker.slots import GiB, Slots, plan_slots, split_cores

from .conftest import wait_for


def test_cores_split_into_contiguous_runs_or_shared_round_robin():
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([4, 5, 6, 7], 4) == [[4], [5], [6], [7]]
    assert split_cores([0, 1], 3) == [[0], [1], [0]]
    assert split_cores([0, 1, 2], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="slots=0"):
        split_cores([0], 0)


def test_slot_budgets_are_memory_gib_else_the_device_split_evenly():
    slots = plan_slots([0, 1, 2, 3], 2, None, None, 8 * GiB)
    assert [(s.index, s.cores, s.threads, s.budget_bytes) for s in slots] == [
        (0, [0, 1], 2, 4 * GiB), (1, [2, 3], 2, 4 * GiB)]
    assert {s.budget_bytes for s in plan_slots([0], 4, 1, 1.5, 80 * GiB)} == {int(1.5 * GiB)}
    assert {s.threads for s in plan_slots([0, 1, 2, 3], 2, 3, None, None)} == {3}
    assert plan_slots([0], 1, None, None, None)[0].budget_bytes is None


@pytest.mark.timeout(10)
def test_the_slot_table_hands_out_the_lowest_free_slot_and_waits_when_all_are_busy():
    table = Slots(plan_slots([0, 1], 2, None, None, None))
    with table.take() as first, table.take() as second:
        assert (first.index, second.index, table.busy) == (0, 1, 2)
        got: list[int] = []
        taken = threading.Event()

        def third() -> None:
            with table.take() as slot:
                got.append(slot.index)
                taken.set()

        waiter = threading.Thread(target=third)
        waiter.start()
        assert not taken.wait(0.2)  # every slot busy: it waits
    assert taken.wait(5)  # both freed: it took the lowest
    waiter.join(5)
    assert got == [0] and table.busy == 0


def test_fan_out_keys_of_one_job_per_slot_name_their_device():
    assert slot_key("cpu0", 1) == "cpu0/1"
    assert key_device("cpu0/1") == "cpu0" and key_device("gpu2@hosta") == "gpu2@hosta"


def test_worker_config_reads_concurrency_as_slots_and_refuses_bad_values(tmp_path):
    assert WorkerConfig.model_validate({"kind": "cpu", "concurrency": 3}).slots == 3
    with pytest.raises(ValueError, match="concurrency is the old name of slots"):
        WorkerConfig.model_validate({"kind": "cpu", "concurrency": 3, "slots": 2})
    with pytest.raises(ValueError, match="mps = true is for GPU workers"):
        WorkerConfig.model_validate({"kind": "cpu", "mps": True})
    (tmp_path / "gpu.toml").write_text('kind = "gpu"\nslots = 4\nmemory_gib = -1\n')
    with pytest.raises(ConfigError, match=r"gpu\.toml: memory_gib=-1"):
        load_worker_config(tmp_path, Device(DeviceKind.GPU, 0))


def test_the_resident_meter_counts_a_process_and_its_children():
    meter = ResidentMeter()
    alone = meter.used(os.getpid())
    assert alone is not None and alone > 0
    child = subprocess.Popen([sys.executable, "-c", "import sys; x = b'x' * (64 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        wait_for(lambda: (meter.used(os.getpid()) or 0) > alone + (48 << 20), 10, "the child's memory counted")
    finally:
        child.communicate(b"", timeout=10)
    assert meter.used(2**22 + 7) is None  # no such process


def test_the_resident_meters_exact_figure_counts_shared_pages_once():
    # A process that wrote 64 MiB and then forked: the child shares those pages (copy on write).
    code = "import os, sys; x = bytearray(b'x') * (64 << 20); os.fork(); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    meter = ResidentMeter()
    try:
        wait_for(lambda: (meter.used(proc.pid) or 0) > (128 << 20), 10, "both processes holding the pages")
        quick, exact = meter.used(proc.pid), meter.exact(proc.pid)
        assert quick is not None and exact is not None
        assert quick - exact > (48 << 20), (quick >> 20, exact >> 20)  # RSS counted them twice, PSS once
    finally:
        proc.communicate(b"", timeout=10)


def test_the_device_meter_sums_nvmls_figures_for_the_process_tree():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        gpu_processes = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=500), SimpleNamespace(pid=child.pid, usedGpuMemory=20),
                         SimpleNamespace(pid=1, usedGpuMemory=10_000), SimpleNamespace(pid=child.pid + 99_999, usedGpuMemory=None)]
        nvml = SimpleNamespace(nvmlDeviceGetComputeRunningProcesses=lambda handle: gpu_processes)
        assert DeviceMeter(nvml, handle=object()).used(os.getpid()) == 520
    finally:
        child.communicate(b"", timeout=10)


def test_a_gpu_meter_without_nvml_is_none_and_says_why(caplog):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this host has NVML: its GPU meter measures")
    with caplog.at_level("WARNING"):
        assert open_meter("gpu", None, 0, "gpu0") is None
    assert "allocator's cap only" in caplog.text and "NVML" in caplog.text
    assert open_meter("cpu", None, 0, "cpu0").kind == "resident"  # type: ignore[union-attr]


GPU1_UUID = "GPU-5a1b2c3d-0000-1111-2222-333344445555"


def _control_program(folder: Path) -> Path:
    """A stand-in for nvidia-cuda-mps-control (not on this host): it logs its argv, its pipe
    folder and what it reads on stdin, as the real one takes ``-d`` and ``quit``."""
    program = folder / "nvidia-cuda-mps-control"
    program.write_text("#!/bin/sh\n"
                       'log="$CUDA_MPS_PIPE_DIRECTORY/../calls"\n'
                       'if [ "$1" = "-d" ]; then echo "daemon $CUDA_VISIBLE_DEVICES" >> "$log"; exit 0; fi\n'
                       'read -r line; echo "control $line" >> "$log"\n')
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return program


def test_the_mps_daemon_is_started_for_the_gpu_and_told_to_quit(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    server = MpsServer(Device(DeviceKind.GPU, 1), tmp_path / "state")
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control is not on PATH"):
        server.start(None)
    _control_program(bin_dir)
    monkeypatch.setattr(server, "gpu_uuid", lambda: GPU1_UUID)  # what torch says on a GPU host
    client = server.start(2 * GiB)
    # The daemon and its clients see GPU 1 by its UUID: an MPS server renumbers its devices, so a
    # client keeping CUDA_VISIBLE_DEVICES=1 would see none.
    assert client == {"CUDA_VISIBLE_DEVICES": GPU1_UUID, "CUDA_MPS_PIPE_DIRECTORY": str(server.pipe_dir),
                      "CUDA_MPS_LOG_DIRECTORY": str(server.log_dir), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}
    server.stop()
    calls = (server.folder / "calls").read_text().splitlines()
    # A daemon left on the pipe folder is told to quit first; then it starts for GPU 1; then quits.
    assert calls == ["control quit", f"daemon {GPU1_UUID}", "control quit"]


def test_no_uuid_from_torch_for_the_mps_daemon_refuses_to_start_naming_the_gpu(tmp_path, monkeypatch):
    # The real probe, on a host where torch sees no GPU: no UUID, no daemon.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _control_program(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    server = MpsServer(Device(DeviceKind.GPU, 1), tmp_path / "state")
    with pytest.raises(FleetError, match="gpu1: torch gave no UUID for GPU 1"):
        server.start(None)
    assert (server.folder / "calls").read_text().splitlines() == ["control quit"]  # a leftover's only: no daemon


def test_a_gpus_uuid_is_spelled_as_nvml_spells_it():
    from tasks.core.devices import _nvml_uuid

    assert _nvml_uuid("3f4c-aa") == "GPU-3f4c-aa"
    assert _nvml_uuid("GPU-3f4c-aa") == "GPU-3f4c-aa" and _nvml_uuid("MIG-1") == "MIG-1"
    assert _nvml_uuid(None) is None
