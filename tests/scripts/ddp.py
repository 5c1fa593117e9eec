"""A DDP script as torchrun runs it: the process group from the environment only
(``init_process_group("gloo")``), one all-reduce, no devicefleet import.

``--crash-rank R`` makes rank R's job process die the first time (its parent, SIGKILL), as a
crash takes a rank down: the gang restarts and runs the script again."""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--marker", help="Append 'pid restart-count' to <marker>/<device>.")
args = parser.parse_args()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if args.marker:
    with open(os.path.join(args.marker, os.environ["DEVICEFLEET_DEVICE"]), "a") as handle:
        handle.write(f"{os.getpid()} {restart}\n")
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == args.crash_rank and restart == 0:
    os.kill(os.getppid(), signal.SIGKILL)  # the rank's job process dies, and this command with it
    signal.pause()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
         "DEVICEFLEET_DIST_BACKEND")
print(f"rank {rank} of {dist.get_world_size()} sum {value.item()}", flush=True)
with open(os.environ["DEVICEFLEET_EVENTS"], "w") as events:
    events.write(json.dumps({"output": {"sum": value.item(), "env": {n: os.environ.get(n) for n in names}}}) + "\n")
dist.destroy_process_group()
