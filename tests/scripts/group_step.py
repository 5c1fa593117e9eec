"""One DDP training step over a process group, shared by the two launcher examples beside it
(``spawn_gloo.py``, ``torchrun_gloo.py``): each rank trains a linear model one step on its own
batch, and rank 0 prints one JSON line saying what the group did."""

import json
import os

import torch
import torch.distributed as dist
from torch import nn


def device_of(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` where this process sees GPUs (the launchers' habit), else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def train_step(rank: int, world_size: int, local_rank: int) -> None:
    """One step of DDP; the ranks' weights must be equal after it (gradients averaged)."""
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
    if rank == 0:
        print(json.dumps({
            "world_size": world_size, "backend": dist.get_backend(), "rank_sum": ranks.item(),
            "weights_equal": all(torch.equal(gathered[0], g) for g in gathered),
            "pid": os.getpid(),
            # The cores rank 0 may run on: under a device group, the union of its devices' cores.
            "affinity": sorted(os.sched_getaffinity(0)),
        }), flush=True)
    # Every rank past its last collective before any tears its group down: a gloo rank whose peer
    # had already destroyed its group and exited could abort in its own teardown (`terminate
    # called without an active exception`, SIGABRT; issue 51).
    dist.barrier()
