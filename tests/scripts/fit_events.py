import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
path = os.environ.get("DEVICEFLEET_EVENTS")
events = open(path, "w", buffering=1) if path else None     # line-buffered: each event at once

def emit(**event):
    if events:
        events.write(json.dumps(event) + "\n")

loss = 1.0
for epoch in range(args.epochs):
    loss *= 1 - args.lr
    print(f"epoch {epoch} loss {loss:.4f}")
    emit(progress={"step": epoch + 1, "total": args.epochs, "value": loss})
    emit(scalars={"loss": loss}, step=epoch)
emit(output={"loss": loss})
