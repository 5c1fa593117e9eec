"""A training script as ``torchrun --standalone --nproc_per_node=K torchrun_gloo.py`` runs it: the
process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``),
``cuda:<LOCAL_RANK>`` where GPUs are visible, gloo on CPUs. Runs the same on a plain host and
under ``devicefleet run --group K -- torchrun ...``."""

import os

import torch.distributed as dist
from group_step import backend, report, train_step

if __name__ == "__main__":
    dist.init_process_group(backend())
    try:
        done = train_step(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]))
    finally:
        dist.destroy_process_group()
    report(done)
