"""A training script as people write them (argparse, prints), that knows nothing of devicefleet
but the events pipe its docs describe: the command tests run it on the fleet."""

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--wait-for", help="After the first line, wait until this file exists.")
    args = parser.parse_args()
    print(f"device={os.environ.get('DEVICEFLEET_DEVICE')} cuda={os.environ.get('CUDA_VISIBLE_DEVICES')} "
          f"omp={os.environ.get('OMP_NUM_THREADS')} cwd={os.getcwd()} cores={sorted(os.sched_getaffinity(0))}",
          flush=True)
    if args.wait_for:
        while not os.path.exists(args.wait_for):
            time.sleep(0.02)
    events = os.environ.get("DEVICEFLEET_EVENTS")
    with open(events, "w", buffering=1) if events else open(os.devnull, "w") as out:
        loss = 1.0
        for step in range(1, args.steps + 1):
            loss = round(args.lr * 10 / step, 6)
            print(f"step {step} loss {loss}")
            print(f"warning {step}", file=sys.stderr)
            out.write(json.dumps({"progress": {"step": step, "total": args.steps, "loss": loss}}) + "\n")
            out.write(json.dumps({"scalars": {"loss": loss}, "step": step}) + "\n")
        out.write(json.dumps({"output": {"loss": loss, "lr": args.lr}}) + "\n")
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
