"""``hogwild``: train one model in several processes of one host, its parameters in shared memory.

Hogwild (Niu, Recht, Ré and Wright, 2011, arXiv:1106.5730): M processes train the same model at
once, each on its share of every epoch's batches, writing their updates into the shared
parameters without locks. The recipe is the one of PyTorch's multiprocessing notes
(https://pytorch.org/docs/stable/notes/multiprocessing.html, "Hogwild" and "CPU oversubscription"):

- the model's parameters move to shared memory (``model.share_memory()``) before the processes
  start; the gradients are not shared: each process allocates its own on its first backward;
- the processes start with the ``spawn`` start method;
- each process builds its own optimizer, so the optimizer's state (Adam's moments) is its own,
  as in the notes' example, where ``train()`` creates the optimizer inside each process;
- each process sets ``torch.set_num_threads(cores // M)``: M processes that each use every core
  oversubscribe the CPU (the notes report a 30x speed-up from setting it).

The cores are this process's own affinity (``os.sched_getaffinity(0)``): the device's cores on one
device, the union of the devices' cores when the job process serves a group of devices.

The processes are children of the job process and stay in its process group: a cancel or a time
limit seen at ``ctx.progress()`` ends them before the job returns, the worker's SIGTERM/SIGKILL
of the job process's group (a time limit past its grace, a worker's stop) reaches them too, and
each asks the kernel for SIGKILL should the job process die first (``PR_SET_PDEATHSIG``).

``processes=1`` runs the same training in the job process itself: the baseline that the tests
and ``devicefleet bench`` compare Hogwild with (same data, epochs and seed).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Annotated, Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..core.children import die_with_parent
from ..core.defaults import HOGWILD_POLL_S, HOGWILD_STOP_GRACE_S
from ..core.errors import JobError, TrainingDiverged
from ..core.job import JobContext, JobMetric, job
from . import data
from .models import TrainingParams, build

logger = logging.getLogger(__name__)


#: ``(epoch, summed loss, correct, samples)`` of one process's epoch.
EpochReport = Callable[[int, float, int, int], None]


class HogwildParams(TrainingParams):
    #: Training processes; ``auto``: one per core of the job process's affinity.
    processes: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"


def plan(cores: int, processes: int | Literal["auto"]) -> tuple[int, int]:
    """``(processes, torch threads of each)`` for ``cores`` cores: ``cores // processes``
    threads each, at least one (more processes than cores oversubscribe; the result says so)."""
    count = max(1, cores) if processes == "auto" else processes
    return count, max(1, cores // count)


def optimizer_for(net: nn.Module, params: HogwildParams) -> torch.optim.Optimizer:
    """This process's own optimizer over ``net``'s parameters (its state is this process's).

    Built before the training is timed: the first optimizer a process builds imports
    ``torch._dynamo`` (``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``),
    about 1.2 s of CPU on a 2-core VM against 1.3 s for a process's half of the bench's 60
    epochs. Counted in the training, it made each fresh training process pay it and the
    one-process run (already warm) not, so the speed-up measured the import, not Hogwild."""
    return torch.optim.Adam(net.parameters(), lr=params.lr)


def train_share(net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                params: HogwildParams, rank: int, processes: int, report: EpochReport) -> None:
    """Train ``net`` with ``optimizer`` (:func:`optimizer_for`) on process ``rank``'s share of each
    epoch: every ``processes``-th sample of the epoch's shuffle, which every process draws alike
    (seeded by ``seed`` and the epoch), so the shares of an epoch are disjoint and cover the
    training set. Calls ``report`` per epoch."""
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    for epoch in range(1, params.epochs + 1):
        for group in optimizer.param_groups:
            group["lr"] = params.lr * (1 - (epoch - 1) / params.epochs)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(params.seed + epoch))
        share = order[rank::processes]
        loss_sum = torch.zeros(())
        correct = torch.zeros((), dtype=torch.long)
        for start in range(0, len(share), params.batch_size):
            index = share[start : start + params.batch_size]
            xb, yb = x[index], y[index]
            optimizer.zero_grad(set_to_none=True)
            logits = net(xb)
            loss = loss_fn(logits, yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(yb)
            correct += (logits.detach().argmax(dim=1) == yb).sum()
        report(epoch, float(loss_sum), int(correct), len(share))


def _child(rank: int, processes: int, parent: int, net: nn.Module, x: torch.Tensor, y: torch.Tensor,
           params: HogwildParams, threads: int, conn: Connection) -> None:
    """One training process: build its optimizer, say ready, wait for ``go``, train, say done with
    the training's CPU time (or the error), and end without the interpreter's teardown."""
    die_with_parent(parent)
    torch.set_num_threads(threads)
    try:
        optimizer = optimizer_for(net, params)
        conn.send(("ready", rank))
        if conn.recv() != "go":
            return
        cpu = time.process_time()
        train_share(net, optimizer, x, y, params, rank, processes,
                    lambda epoch, loss, correct, n: conn.send(("epoch", rank, epoch, loss, correct, n)))
        conn.send(("done", rank, time.process_time() - cpu))
        conn.close()
    except Exception as exc:
        try:
            conn.send(("error", rank, f"{type(exc).__name__}: {exc}"))
        finally:
            raise SystemExit(1) from None
    # Done: nothing is left to flush or release (the parameters are the parent's, the pipe is
    # closed), and a normal exit's teardown of torch's modules costs ~1.1 s of CPU per process on
    # a 2-core VM, which the job process would wait for in its join.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Epochs:
    """The processes' epoch reports, folded into one loss curve as each epoch completes."""

    def __init__(self, ctx: JobContext, params: HogwildParams, processes: int) -> None:
        self.ctx, self.params, self.processes = ctx, params, processes
        self.pending: dict[int, list[tuple[float, int, int]]] = {}
        self.history: list[dict[str, float]] = []

    @property
    def loss(self) -> float:
        return self.history[-1]["loss"] if self.history else math.nan

    def add(self, epoch: int, loss: float, correct: int, n: int) -> None:
        parts = self.pending.setdefault(epoch, [])
        parts.append((loss, correct, n))
        if len(parts) < self.processes:
            return
        del self.pending[epoch]
        seen = sum(p[2] for p in parts) or 1
        epoch_loss, accuracy = sum(p[0] for p in parts) / seen, sum(p[1] for p in parts) / seen
        if not math.isfinite(epoch_loss):
            raise TrainingDiverged(f"loss became {epoch_loss} at epoch {epoch} (lr={self.params.lr}); "
                                   "lower the learning rate or check the dataset")
        self.history.append({"epoch": epoch, "loss": epoch_loss, "accuracy": accuracy})
        self.ctx.log(epoch, **{"loss/train": epoch_loss, "accuracy/train": accuracy})
        self.report()

    def report(self) -> None:
        """Progress: the last complete epoch and its loss. Raises when the job was cancelled or
        ran past its time limit (``ctx.progress``)."""
        fields: dict[str, Any] = {"epoch": len(self.history), "epochs": self.params.epochs}
        if self.history:
            fields["loss"] = round(self.loss, 6)
        self.ctx.progress(**fields)


def _stop(procs: list[Any]) -> None:
    """End the children still running: SIGTERM, then SIGKILL after :data:`HOGWILD_STOP_GRACE_S`."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + HOGWILD_STOP_GRACE_S
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _tracker_running() -> bool:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_fd", None) is not None


def _stop_tracker() -> None:
    """Stop Python's resource tracker, which the ``spawn`` start method starts in the parent on
    the first spawn; the job registered nothing with it (pipes, no named semaphores), so the
    job process is left with no child of the job's (the next spawn starts it again)."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


def _run_children(ctx: JobContext, params: HogwildParams, net: nn.Module, split: data.Split,
                  processes: int, threads: int, epochs: _Epochs) -> tuple[float, float, list[float]]:
    """Train ``net`` in ``processes`` spawned processes; returns ``(start_s, train_s,
    train_cpu_s)``: from the spawn until every process is ready (its imports and its optimizer),
    from ``go`` until the last is done, and each process's CPU time in its training."""
    mp = torch.multiprocessing.get_context("spawn")
    net.share_memory()
    x, y = split.x_train.share_memory_(), split.y_train.share_memory_()
    started = time.perf_counter()
    pipes = [mp.Pipe() for _ in range(processes)]
    procs = [mp.Process(target=_child, name=f"hogwild-{rank}", daemon=True,
                        args=(rank, processes, os.getpid(), net, x, y, params, threads, pipes[rank][1]))
             for rank in range(processes)]
    conns = {pipes[rank][0]: rank for rank in range(processes)}
    ready: set[int] = set()
    done: dict[int, float] = {}  # rank: its training's CPU time
    go = math.nan
    tracker_before = _tracker_running()
    try:
        for proc, (_, child_end) in zip(procs, pipes, strict=True):
            proc.start()
            child_end.close()
        while len(done) < processes:
            # Cancelled or past its time limit: raises here, and the finally ends the children.
            epochs.report()
            for conn in wait(list(conns), timeout=HOGWILD_POLL_S):
                assert isinstance(conn, Connection)
                try:
                    message = conn.recv()
                except EOFError:  # the process ended (its end of the pipe closed with it)
                    rank = conns.pop(conn)
                    if rank not in done:
                        procs[rank].join(HOGWILD_STOP_GRACE_S)
                        raise JobError(f"hogwild process {rank} of {processes} ended (exit status "
                                       f"{procs[rank].exitcode}) before it was done") from None
                    continue
                kind, rank = message[0], message[1]
                if kind == "ready":
                    ready.add(rank)
                    if len(ready) == processes:
                        go = time.perf_counter()
                        for parent_end in conns:
                            parent_end.send("go")
                elif kind == "epoch":
                    epochs.add(*message[2:])
                elif kind == "done":
                    done[rank] = message[2]
                else:
                    raise JobError(f"hogwild process {rank} of {processes} raised {message[2]}")
        finished = time.perf_counter()
        for proc in procs:
            proc.join()
    finally:
        _stop(procs)
        for parent_end, _ in pipes:
            parent_end.close()
        if not tracker_before:
            _stop_tracker()
    return go - started, finished - go, [done[rank] for rank in range(processes)]


@job("hogwild", params=HogwildParams, metrics={"samples_per_s": JobMetric.SAMPLES_PER_S})
def hogwild(ctx: JobContext, params: HogwildParams) -> dict[str, Any]:
    """Train ``model`` on ``dataset`` in ``processes`` processes sharing its parameters (Hogwild);
    returns accuracy, loss, processes, threads and the times."""
    started = time.perf_counter()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(ctx.cores)
    processes, threads = plan(len(cores), params.processes)
    torch.manual_seed(params.seed)
    split = data.load(params.dataset, test_fraction=params.test_fraction, seed=params.seed)
    net = build(params.model, split.features, split.classes, params.hidden)
    epochs = _Epochs(ctx, params, processes)
    if processes == 1:
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            optimizer = optimizer_for(net, params)
            go, cpu = time.perf_counter(), time.process_time()
            train_share(net, optimizer, split.x_train, split.y_train, params, 0, 1, epochs.add)
            start_s, train_s, train_cpu_s = 0.0, time.perf_counter() - go, [time.process_time() - cpu]
        finally:
            torch.set_num_threads(threads_before)
    else:
        start_s, train_s, train_cpu_s = _run_children(ctx, params, net, split, processes, threads, epochs)

    net.eval()
    with torch.inference_mode():
        accuracy = float((net(split.x_test).argmax(dim=1) == split.y_test).float().mean())
    ctx.log(params.epochs, **{"accuracy/test": accuracy})
    samples = len(split.y_train) * params.epochs
    logger.info("%s: hogwild %s on %s, %d processes x %d threads, accuracy %.4f in %.2f s",
                ctx.device, params.model.value, split.name, processes, threads, accuracy, train_s)
    # The first numeric fields are what `devicefleet run` shows in its table.
    return {
        "accuracy": accuracy,
        "loss": epochs.loss,
        "processes": processes,
        "threads": threads,
        "wall_s": time.perf_counter() - started,
        "train_s": train_s,
        # From the spawn until every process had imported torch, built its optimizer and was
        # ready (0 in one process).
        "start_s": start_s,
        "samples_per_s": samples / train_s if train_s > 0 else None,
        # Each process's CPU time in the training phase: what the host's other load moves least.
        "train_cpu_s": train_cpu_s,
        "cores": cores,
        "devices": list(ctx.devices),  # a group's devices, its leader first
        "model": params.model.value,
        "dataset": split.name,
        "epochs": params.epochs,
        "train_samples": len(split.y_train),
        "test_samples": len(split.y_test),
        "torch_device": "cpu",
        "history": epochs.history,
    }
