import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
...   # DistributedDataParallel, DistributedSampler, as usual
dist.destroy_process_group()
