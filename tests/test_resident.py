"""Data that lives on the device (tasks/jobs/resident.py): the fits-or-not rule and the batches.

In-process tests of pure logic; the ``train`` job's use of it runs in tests/test_loader.py.
"""

from __future__ import annotations

import pytest
import torch

import tasks
from tasks.core.errors import DatasetError
from tasks.core.job import JobContext
from tasks.jobs.resident import DeviceData, decide, place_data, tensor_bytes

MiB = 1024 * 1024


def test_decide_fits_within_the_fraction_of_the_budget() -> None:
    assert decide(10 * MiB, "cuda:0", 100 * MiB, fraction=0.5).path == "device"
    over = decide(60 * MiB, "cuda:0", 100 * MiB, fraction=0.5)
    assert over.path == "loader" and "60.0 MiB" in over.note and "100 MiB" in over.note
    assert over.limit_bytes == 50 * MiB


def test_decide_without_a_budget_keeps_the_data_where_it_is() -> None:
    placement = decide(10**12, "cpu", None)
    assert placement.on_device and placement.limit_bytes is None


def test_decide_follows_the_mode_and_refuses_an_impossible_device_path() -> None:
    assert decide(1, "cpu", None, "loader").path == "loader"
    assert decide(80 * MiB, "cuda:0", 100 * MiB, "device", fraction=0.5).path == "device"
    with pytest.raises(DatasetError, match="200.0 MiB.*data='auto'"):
        decide(200 * MiB, "cuda:0", 100 * MiB, "device")


def test_place_data_reads_the_jobs_budget(tmp_path) -> None:
    x = torch.zeros(1000, 64)
    ctx = JobContext(device="cpu0", torch_device="cpu", job_id="j", artifacts_dir=tmp_path,
                     memory_budget_bytes=tensor_bytes(x))
    assert place_data(ctx, x).path == "loader"  # over half of its budget
    assert place_data(ctx, x[:100]).path == "device"
    assert tasks.place_data is place_data and tasks.DeviceData is DeviceData


def test_batches_cover_every_sample_once_per_epoch_reproducibly() -> None:
    x = torch.arange(103, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(103)
    data = DeviceData.from_tensors(x, y, device="cpu")
    epoch = list(data.batches(10, data.generator(7)))
    assert [len(b[1]) for b in epoch] == [10] * 10 + [3]
    seen = torch.cat([b[1] for b in epoch])
    assert sorted(seen.tolist()) == list(range(103))
    assert seen.tolist() != list(range(103))  # shuffled
    assert all(torch.equal(b[0].squeeze(1).long(), b[1]) for b in epoch)  # rows stay paired
    again = torch.cat([b[1] for b in data.batches(10, data.generator(7))])
    assert torch.equal(seen, again)
    other = torch.cat([b[1] for b in data.batches(10, data.generator(8))])
    assert not torch.equal(seen, other)


def test_ranks_share_one_permutation_and_split_it_like_distributed_sampler() -> None:
    data = DeviceData.from_tensors(torch.arange(10), device="cpu")
    shards = [torch.cat([b[0] for b in data.batches(2, data.generator(3), rank=r, world_size=3)])
              for r in range(3)]
    assert [len(s) for s in shards] == [data.shard_size(3)] * 3 == [4, 4, 4]
    together = torch.cat(shards).tolist()
    assert set(together) == set(range(10)) and len(together) == 12  # padded by wrapping around


def test_unequal_tensors_are_refused() -> None:
    with pytest.raises(DatasetError, match=r"\[3, 4\]"):
        DeviceData.from_tensors(torch.zeros(3), torch.zeros(4), device="cpu")


@pytest.mark.gpu
def test_batches_are_drawn_and_indexed_on_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    data = DeviceData.from_tensors(torch.randn(1000, 8), torch.arange(1000), device="cuda")
    batches = list(data.batches(64, data.generator(0)))
    assert all(t.is_cuda for b in batches for t in b)
    assert sorted(torch.cat([b[1] for b in batches]).tolist()) == list(range(1000))


def _train(tmp_path, torch_device: str = "cpu", budget: int | None = None, **params):
    from tasks.jobs.train import TrainParams, train

    ctx = JobContext(device="cpu0", torch_device=torch_device, job_id="t", artifacts_dir=tmp_path / "t",
                     cores=[0], threads=1, memory_budget_bytes=budget)
    params = {"epochs": 3, "num_workers": 0, "checkpoint_every_s": 3600, **params}
    return train(ctx, TrainParams(**params))


def test_train_keeps_data_that_fits_on_the_device_and_says_so(tmp_path) -> None:
    out = _train(tmp_path)
    assert out["data_path"]["path"] == "device" and "fits" in out["data_path"]["note"], out["data_path"]
    assert out["num_workers"] == 0 and out["accuracy"] >= 0.8
    assert out["samples_seen"] == 3 * out["train_samples"]
    assert out["weights_digest"] == _train(tmp_path)["weights_digest"]  # reproducible from its seed


def test_train_gives_the_same_model_on_either_path(tmp_path) -> None:
    """The device path takes its batches in the loader's order: one seed, one model."""
    device, loader = _train(tmp_path, data="device"), _train(tmp_path, data="loader")
    assert device["data_path"]["path"] == "device" and loader["data_path"]["path"] == "loader"
    assert device["weights_digest"] == loader["weights_digest"]
    assert device["history"] == loader["history"]


def test_a_given_order_is_followed_and_sharded() -> None:
    data = DeviceData.from_tensors(torch.arange(6), device="cpu")
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    assert torch.cat([b[0] for b in data.batches(4, order=order)]).tolist() == [5, 4, 3, 2, 1, 0]
    assert torch.cat([b[0] for b in data.batches(4, order=order, rank=1, world_size=2)]).tolist() == [4, 2, 0]


def test_train_feeds_data_over_its_budget_or_asked_for_through_the_loader(tmp_path) -> None:
    over = _train(tmp_path, budget=100_000)  # digits' train split is ~0.36 MiB
    assert over["data_path"]["path"] == "loader" and "is over 50%" in over["data_path"]["note"]
    asked = _train(tmp_path, data="loader")
    assert asked["data_path"]["path"] == "loader" and asked["accuracy"] >= 0.8
    workers = _train(tmp_path, num_workers=1)
    assert workers["data_path"]["path"] == "loader" and workers["num_workers"] == 1


@pytest.mark.gpu
def test_train_on_a_gpu_with_resident_data_hardly_waits_for_it(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = _train(tmp_path, torch_device="cuda:0", epochs=15)
    print(f"\nGPUCHECK 48 train on cuda:0: {out['data_path']}, {out['samples_per_s']:,.0f} samples/s, "
          f"data_wait_fraction {out['data_wait_fraction']:.3f}")
    assert out["data_path"]["path"] == "device"
    assert out["data_wait_fraction"] <= 0.05
