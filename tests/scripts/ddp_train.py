import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # before the group: see "A rank's teardown" below

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# DistributedDataParallel, DistributedSampler, as usual; here, one all-reduce:
device = "cuda" if torch.cuda.is_available() else "cpu"
total = torch.tensor([float(dist.get_rank() + 1)], device=device)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item()}")
dist.destroy_process_group()
