"""A trial that reports its score as its intermediate value ``--steps`` times over ``--seconds``
on the events pipe, then outputs it: what a study prunes."""

import argparse
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--score", type=float, required=True)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--seconds", type=float, default=3.0)
args = parser.parse_args()
with open(os.environ["DEVICEFLEET_EVENTS"], "w", buffering=1) as events:
    for step in range(1, args.steps + 1):
        time.sleep(args.seconds / args.steps)
        events.write(json.dumps({"progress": {"step": step, "total": args.steps, "value": args.score}}) + "\n")
    events.write(json.dumps({"output": {"score": args.score}}) + "\n")
