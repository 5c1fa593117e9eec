import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

loss = 1.0
for epoch in range(args.epochs):
    loss *= 1 - args.lr                      # one epoch of training
    print(f"epoch {epoch} loss {loss:.4f}")
