"""Scripts that start their own processes over the devices they see (issue 40, item 6): one that
calls ``mp.spawn``, one that ``torchrun --standalone --nproc_per_node=2`` runs. Each runs here as a
plain command with the gloo backend, as it will run unchanged as a device group's command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import SCRIPTS, test_env

pytestmark = pytest.mark.timeout(150)


def _run(argv: list[str]) -> dict[str, object]:
    env = {**os.environ, **test_env()}
    proc = subprocess.run(argv, cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 alone reports
    return json.loads(lines[0])


@pytest.mark.parametrize("argv", [
    [sys.executable, "spawn_gloo.py", "--nprocs", "2"],
    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "torchrun_gloo.py"],
], ids=["mp_spawn", "torchrun"])
def test_a_launcher_script_trains_over_two_processes_with_gloo(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU, on any host
    report = _run(argv)
    assert report == {**report, "world_size": 2, "backend": "gloo", "rank_sum": 1.0, "weights_equal": True}
