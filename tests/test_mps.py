"""The MPS daemon of a GPU worker (tasks/worker/mps.py), with a stand-in ``nvidia-cuda-mps-control``
that records how it was run (no GPU here): the GPU is named by its UUID to the daemon and its
clients, never by an index the MPS server would renumber."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tasks.core.devices import Device
from tasks.core.errors import FleetError
from tasks.worker.mps import MPS_CONTROL, MpsServer

pytestmark = pytest.mark.timeout(120)

UUID = "GPU-5a1b2c3d-0000-1111-2222-333344445555"


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in control program first on PATH: each run appends its arguments, input and MPS
    variables to the file it returns."""
    folder, record = tmp_path / "bin", tmp_path / "runs.jsonl"
    folder.mkdir()
    program = folder / MPS_CONTROL
    program.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        "data = '' if sys.stdin.isatty() else sys.stdin.read()\n"
        f"with open({str(record)!r}, 'a') as out:\n"
        "    out.write(json.dumps({'args': sys.argv[1:], 'input': data, 'env': {k: v for k, v in os.environ.items()"
        " if k.startswith('CUDA_')}}) + '\\n')\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return record


def _runs(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_the_daemon_and_its_clients_see_the_gpu_by_its_uuid(control: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    server = MpsServer(Device.parse("gpu1"), tmp_path / "state")
    monkeypatch.setattr(server, "gpu_uuid", lambda: UUID)  # torch's answer on a GPU host
    client = server.start(budget_bytes=8 << 30)
    server.stop()
    assert client == {"CUDA_VISIBLE_DEVICES": UUID, "CUDA_MPS_PIPE_DIRECTORY": str(server.pipe_dir),
                      "CUDA_MPS_LOG_DIRECTORY": str(server.log_dir), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}
    leftover_quit, daemon, quit_ = _runs(control)
    assert daemon["args"] == ["-d"] and daemon["env"]["CUDA_VISIBLE_DEVICES"] == UUID
    assert daemon["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(server.pipe_dir)
    assert [leftover_quit["input"], quit_["input"]] == ["quit\n", "quit\n"]


def test_no_uuid_from_torch_refuses_to_start_naming_the_gpu(control: Path, tmp_path: Path) -> None:
    # The real probe, on this machine without a GPU: torch sees none, so no UUID.
    server = MpsServer(Device.parse("gpu1"), tmp_path / "state")
    with pytest.raises(FleetError, match="gpu1: torch gave no UUID for GPU 1"):
        server.start(budget_bytes=None)
    assert not control.exists()  # no daemon was started
