"""One DDP training step over a process group, shared by the two launcher examples beside it
(``spawn_gloo.py``, ``torchrun_gloo.py``): each rank trains a linear model one step on its own
batch, and rank 0 prints one JSON line saying what the group did, once its group is gone."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

# Before any process group exists (issue 51): DistributedDataParallel imports this module, whose
# functions take ``group=group.WORLD`` as a default, evaluated at its first import; imported once
# the group exists, it keeps the group and gloo's threads alive past destroy_process_group until
# the interpreter's exit, where a gloo thread could abort the rank ("terminate called without an
# active exception", SIGABRT).
import torch.distributed.nn  # noqa: F401, I001
from torch import nn


def device_of(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` where this process sees GPUs (the launchers' habit), else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def train_step(rank: int, world_size: int, local_rank: int) -> dict | None:
    """One step of DDP; the ranks' weights must be equal after it (gradients averaged). Rank 0
    returns what the group did, for :func:`report` once the group is destroyed."""
    device = device_of(local_rank)
    torch.manual_seed(0)  # the same initial weights; DDP broadcasts rank 0's anyway
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1).to(device),
                                                device_ids=[local_rank] if device.type == "cuda" else None)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    ranks = torch.tensor([float(rank)], device=device)
    dist.all_reduce(ranks)
    if rank != 0:
        return None
    return {
        "world_size": world_size, "backend": dist.get_backend(), "rank_sum": ranks.item(),
        "weights_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "pid": os.getpid(),
        # The cores rank 0 may run on: under a device group, the union of its devices' cores.
        "affinity": sorted(os.sched_getaffinity(0)),
    }


def report(done: dict | None) -> None:
    """Rank 0 prints what its group did, after ``destroy_process_group``, with the gloo threads
    still running in this process (none: the group is gone, not left to the interpreter's exit)."""
    if done is None:
        return
    tasks = Path("/proc/self/task")
    threads = [(tasks / t / "comm").read_text().strip() for t in os.listdir(tasks)] if tasks.is_dir() else []
    print(json.dumps({**done, "gloo_threads_left": sorted(t for t in threads if "gloo" in t)}), flush=True)
