"""A training script that starts its own processes with ``torch.multiprocessing.spawn``, one per
visible device (each visible GPU, else ``--nprocs`` CPU processes: default one per core of this
process's affinity), as nanoGPT's and pytorch/examples' DDP scripts do; gloo on CPUs, nccl on
GPUs. Runs the same as a plain command and as ``devicefleet run --group K -- python spawn_gloo.py``.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from group_step import backend, report, train_step


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group(backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        done = train_step(rank, world_size, local_rank=rank)
    finally:
        dist.destroy_process_group()
    report(done)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=0, help="CPU processes (default: one per core)")
    args = parser.parse_args()
    world_size = torch.cuda.device_count() or args.nprocs or len(os.sched_getaffinity(0))
    mp.spawn(run, args=(world_size, free_port()), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
