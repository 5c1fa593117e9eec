"""``train`` and several GPUs in one process: ``nn.DataParallel`` where it has several, and
what it does instead elsewhere (the result's ``parallel`` field)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.core.job import JobContext
from tasks.jobs.train import Parallel, TrainParams, plan_parallel, train

pytestmark = pytest.mark.timeout(120)


def test_several_visible_gpus_are_split_over_with_the_jobs_own_gpu_first() -> None:
    plan = plan_parallel("cuda:1", 3, 1)
    assert (plan.mode, plan.devices) == ("data_parallel", ["cuda:1", "cuda:0", "cuda:2"])
    assert "nn.DataParallel over 3 visible GPUs" in plan.note


def test_one_gpu_a_cpu_a_rank_or_an_opt_out_get_no_wrap_and_say_why() -> None:
    assert plan_parallel("cuda:0", 1, 1) == Parallel("none", ["cuda:0"], "one visible GPU: no DataParallel wrap")
    cpu = plan_parallel("cpu", 0, 1, threads=2)
    assert (cpu.mode, cpu.devices) == ("none", ["cpu"])
    assert "CPU: no DataParallel" in cpu.note and "its 2 torch threads" in cpu.note and "hogwild" in cpu.note
    assert plan_parallel("cuda:0", 2, 2).mode == "ddp"  # a rank of a distributed job: DDP, never both
    opted_out = plan_parallel("cuda:0", 2, 1, data_parallel=False)
    assert (opted_out.mode, opted_out.devices) == ("none", ["cuda:0"]) and "data_parallel=False" in opted_out.note


@pytest.mark.gpu
def test_train_on_the_visible_gpus_says_how_it_spread(tmp_path: Path) -> None:
    import torch

    ctx = JobContext(device="gpu0", torch_device="cuda:0", job_id="dp-test", artifacts_dir=tmp_path)
    out = train(ctx, TrainParams(epochs=3, num_workers=0))
    expected = plan_parallel("cuda:0", torch.cuda.device_count(), 1, threads=torch.get_num_threads())
    assert out["parallel"] == {"mode": expected.mode, "devices": expected.devices, "note": expected.note}
    assert out["accuracy"] >= 0.8
