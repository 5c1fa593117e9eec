"""``train``: train a real model on a real dataset and save a safetensors checkpoint.

The loop follows the habits that keep a device fed (PyTorch's Performance Tuning Guide,
https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html): a training split that fits the
job's memory budget lives on the device, copied there once, each batch indexed there
(:mod:`.resident`: no loader, no per-batch copy); one that does not is fed by DataLoader workers
that prefetch batches in the background, pinned on CUDA and copied with ``non_blocking=True``;
accumulators live on the device and are read once per epoch (no per-step ``.item()``);
evaluation runs under ``torch.inference_mode()``. Results travel by reference: the checkpoint
stays on disk and only its path goes through Redis.

As a rank of a distributed job (``fan_out("train", devices, distributed=True)``) the model is
wrapped in ``DistributedDataParallel``, each rank trains on its shard of the data
(``DistributedSampler``, reshuffled each epoch), the epoch's loss and accuracy are averaged over
the ranks with ``all_reduce``, and only rank 0 writes checkpoints. Every rank reports
``weights_digest``, a hash of its final parameters: equal on every rank, or DDP did not work.

A job process that sees several GPUs (a group of GPU devices) wraps the model in
``nn.DataParallel``: one process, each batch split over the visible GPUs. Elsewhere it does not,
and its result's ``parallel`` field says what it did instead (:func:`plan_parallel`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ..core.batch_order import LoaderOrder
from ..core.defaults import CHECKPOINT_EVERY_S
from ..core.errors import TrainingDiverged
from ..core.job import JobContext, JobMetric, PackData, Packing, job
from . import data, resume
from .loader import build_loader
from .models import TrainingParams, build
from .resident import DataMode, DeviceData, Placement, place_data, tensor_bytes

logger = logging.getLogger(__name__)


class TrainParams(TrainingParams):
    #: Adam's weight decay (L2, added to the gradient as torch.optim.Adam does).
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    #: DataLoader worker processes (the loader path only: see ``data``); ``auto``: 4 on a GPU,
    #: else one per core beyond the first.
    num_workers: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"
    #: Save a resumable checkpoint (model + optimizer) at most this often; 0: every epoch.
    #: A job that runs again after its worker died resumes from it.
    checkpoint_every_s: float = Field(default=CHECKPOINT_EVERY_S, ge=0)
    #: Split each batch over the visible GPUs with ``nn.DataParallel`` when there are several;
    #: False: train on the first only.
    data_parallel: bool = True
    #: Where the training data lives: ``auto``: on the job's device when it fits its memory budget
    #: (batches indexed there: no DataLoader workers, no per-batch copy), else a DataLoader;
    #: ``device`` or ``loader``: that path. Under ``auto`` a ``num_workers`` above 0 means the
    #: loader. The result's ``data_path`` says which and why.
    data: DataMode = "auto"


@dataclass(frozen=True)
class Parallel:
    """How a ``train`` run spreads over its devices (the result's ``parallel`` field)."""

    #: ``ddp`` (a rank of a distributed job), ``data_parallel`` or ``none``.
    mode: str
    #: The torch devices the model's batches run on.
    devices: list[str]
    #: Why, in words.
    note: str


def plan_parallel(torch_device: str, visible_gpus: int, ranks: int, *, data_parallel: bool = True,
                  threads: int = 0) -> Parallel:
    """What ``train`` does with ``visible_gpus`` GPUs in view, as one of ``ranks`` ranks."""
    if ranks > 1:
        return Parallel("ddp", [torch_device], f"rank of a distributed job of {ranks} ranks: "
                        "DistributedDataParallel, one device per process")
    if not torch_device.startswith("cuda"):
        threads_text = f"its {threads} torch threads" if threads else "its torch threads"
        return Parallel("none", [torch_device], (
            f"CPU: no DataParallel (it splits batches over GPUs only); each batch runs on {threads_text} "
            "over the job's cores; several processes training one model in shared memory: the hogwild job"))
    if visible_gpus <= 1:
        return Parallel("none", [torch_device], "one visible GPU: no DataParallel wrap")
    # The job's own GPU first: DataParallel keeps the module and gathers the outputs there.
    first = int(torch_device.partition(":")[2] or 0)
    gpus = [f"cuda:{index}" for index in [first, *(i for i in range(visible_gpus) if i != first)]]
    if not data_parallel:
        return Parallel("none", [torch_device], f"{visible_gpus} visible GPUs, data_parallel=False: "
                        f"trains on {torch_device} only")
    return Parallel("data_parallel", gpus, f"nn.DataParallel over {visible_gpus} visible GPUs: each batch "
                    f"split over {', '.join(gpus)}, gradients summed on {gpus[0]}")


def _loader_workers(params: TrainParams, ctx: JobContext, cuda: bool) -> int:
    if params.num_workers != "auto":
        return params.num_workers
    cores = len(ctx.cores) or 1
    return min(4, cores) if cuda else min(4, cores - 1)


def _placement(params: TrainParams, ctx: JobContext, split: data.Split) -> Placement:
    """Where the training split lives: ``params.data``; under ``auto`` an explicit
    ``num_workers`` above 0 asks for DataLoader workers, so the loader feeds it."""
    if params.data == "auto" and params.num_workers not in ("auto", 0):
        return Placement("loader", tensor_bytes(split.x_train, split.y_train), None,
                         f"num_workers={params.num_workers} asks for DataLoader workers: a DataLoader feeds it")
    return place_data(ctx, split.x_train, split.y_train, mode=params.data)


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers, by name: equal models, equal digests."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _sum_over_ranks(values: list[torch.Tensor | float], device: torch.device, ranks: int) -> list[float]:
    """``values`` summed over every rank (one ``all_reduce``), as floats."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if ranks > 1:
        import torch.distributed as dist

        dist.all_reduce(stacked)
    return [float(v) for v in stacked.tolist()]


def _pack_data(params: TrainParams) -> PackData:
    split = data.load(params.dataset, test_fraction=params.test_fraction, seed=params.seed)
    return PackData(split.x_train, split.y_train, split.x_test, split.y_test,
                    info={"classes": split.classes, "name": split.name})


def _pack_model(params: TrainParams, pack_data: PackData) -> nn.Module:
    return build(params.model, int(pack_data.x_train[0].numel()), int(pack_data.info["classes"]), params.hidden)


def _pack_output(params: TrainParams, pack_data: PackData) -> dict[str, Any]:
    return {"model": params.model.value, "dataset": pack_data.info["name"],
            "train_samples": len(pack_data.y_train), "test_samples": len(pack_data.y_test), "num_workers": 0,
            "data_path": asdict(Placement("device", tensor_bytes(pack_data.x_train, pack_data.y_train), None,
                                          "packed: the pack's data lives on its device, batches indexed there")),
            "parallel": asdict(Parallel("packed", [], "trained with the other trials of its pack as one vmapped model"))}


def _pack_checkpoint(ctx: JobContext, params: TrainParams, net: nn.Module, optimizer: torch.optim.Optimizer,
                     epoch: int) -> None:
    resume.save(ctx.artifacts_dir, net, optimizer, epoch)


#: ``train``'s trials pack when everything that decides the models' shapes, the data's size and
#: the steps is equal; each keeps its own seed, lr and weight decay.
TRAIN_PACKING = Packing(
    key=("model", "hidden", "dataset", "epochs", "batch_size", "test_fraction"),
    model=_pack_model, data=_pack_data, output=_pack_output, checkpoint=_pack_checkpoint,
)


@job("train", params=TrainParams, pack=TRAIN_PACKING, metrics={
    "samples_seen": JobMetric.SAMPLES,
    "samples_per_s": JobMetric.SAMPLES_PER_S,
    "data_wait_fraction": JobMetric.DATA_WAIT_FRACTION,
})
def train(ctx: JobContext, params: TrainParams) -> dict[str, Any]:
    """Train ``model`` on ``dataset`` for ``epochs``; returns metrics and a checkpoint path."""
    torch.manual_seed(params.seed)
    device = torch.device(ctx.torch_device)
    cuda = device.type == "cuda"
    rank, ranks = ctx.rank, ctx.world_size
    split = data.load(params.dataset, test_fraction=params.test_fraction, seed=params.seed)
    placement = _placement(params, ctx, split)
    sampler: DistributedSampler[Any] | None = None
    if placement.on_device:
        # Copied to the device once, batches indexed there in the order the loader would give
        # (one small host-to-device copy of the order per epoch, none per batch).
        resident: DeviceData | None = DeviceData.from_tensors(split.x_train, split.y_train, device=device)
        order = LoaderOrder(params.seed, len(split.y_train))
        loader = None
        workers = 0
    else:
        resident = None
        workers = _loader_workers(params, ctx, cuda)
        train_set = TensorDataset(split.x_train, split.y_train)
        if ranks > 1:
            sampler = DistributedSampler(train_set, num_replicas=ranks, rank=rank, shuffle=True, seed=params.seed)
        loader = build_loader(
            train_set,
            batch_size=params.batch_size,
            num_workers=workers,
            cuda=cuda,
            shuffle=True,
            seed=params.seed,
            sampler=sampler,
        )
    net = build(params.model, split.features, split.classes, params.hidden).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    n_train = len(split.y_train)
    rank_samples = (resident.shard_size(ranks) if resident is not None else len(sampler) if sampler is not None
                    else n_train)

    if ranks > 1:
        resume.share(ctx.artifacts_dir, rank, device)  # every rank resumes from rank 0's checkpoint
    resumed_from = resume.load(ctx.artifacts_dir, net, optimizer)
    model: nn.Module = net
    parallel = plan_parallel(str(device), torch.cuda.device_count() if cuda else 0, ranks,
                             data_parallel=params.data_parallel, threads=torch.get_num_threads())
    if parallel.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net, device_ids=[device.index or 0] if cuda else None)
    elif parallel.mode == "data_parallel":
        model = nn.DataParallel(net, device_ids=[torch.device(d).index for d in parallel.devices])
    last_save = time.monotonic()

    wait_s = 0.0
    epoch_loss = math.nan
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    for epoch in range(resumed_from + 1, params.epochs + 1):
        model.train()
        if sampler is not None:
            sampler.set_epoch(epoch)
        epoch_started = time.perf_counter()
        epoch_wait = wait_s
        loss_sum = torch.zeros((), device=device)
        correct_sum = torch.zeros((), dtype=torch.long, device=device)
        if resident is None:
            batches: Iterator[Any] = iter(loader or ())
        elif ranks > 1:  # DistributedSampler's own order: a CPU generator seeded seed + epoch
            batches = resident.batches(params.batch_size, torch.Generator().manual_seed(params.seed + epoch),
                                       rank=rank, world_size=ranks)
        else:  # the loader's order: the same batches, and so the same model, on either path
            batches = resident.batches(params.batch_size, order=order.next_epoch())
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            wait_s += time.perf_counter() - t0
            if batch is None:
                break
            xb = batch[0].to(device, non_blocking=True)
            yb = batch[1].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = loss_fn(logits, yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * yb.shape[0]
            correct_sum += (logits.detach().argmax(dim=1) == yb).sum()
        # One device-to-host read per epoch (one all_reduce over the ranks), for the loss curve.
        loss_total, correct_total, seen_total = _sum_over_ranks(
            [loss_sum, correct_sum, float(rank_samples)], device, ranks)
        epoch_loss = loss_total / seen_total
        epoch_accuracy = correct_total / seen_total
        epoch_s = time.perf_counter() - epoch_started
        if not math.isfinite(epoch_loss):
            raise TrainingDiverged(
                f"loss became {epoch_loss} at epoch {epoch} (lr={params.lr}); lower the "
                "learning rate or check the dataset"
            )
        history.append({"epoch": epoch, "loss": epoch_loss, "accuracy": epoch_accuracy})
        # The loss curve: TensorBoard event files, written off this thread (ctx.log buffers).
        ctx.log(epoch, **{
            "loss/train": epoch_loss,
            "accuracy/train": epoch_accuracy,
            "samples_per_s": rank_samples / epoch_s if epoch_s > 0 else 0.0,
            "data_wait_fraction": (wait_s - epoch_wait) / epoch_s if epoch_s > 0 else 0.0,
        })
        # Saved before the report: a preempted run's ctx.progress() raises, and it runs again
        # from this epoch's checkpoint (ctx.preempted(): higher-level work waits for the device).
        due = time.monotonic() - last_save >= params.checkpoint_every_s
        if rank == 0 and epoch < params.epochs and (due or ctx.preempted()):
            resume.save(ctx.artifacts_dir, net, optimizer, epoch, {"loss": epoch_loss})
            last_save = time.monotonic()
        ctx.progress(epoch=epoch, epochs=params.epochs, loss=round(epoch_loss, 6))
    train_s = time.perf_counter() - started

    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    # Each rank scores its share of the test set; the counts are summed over the ranks.
    x_test = split.x_test[rank::ranks].to(device, non_blocking=True)
    y_test = split.y_test[rank::ranks].to(device, non_blocking=True)
    with torch.inference_mode():
        for start in range(0, len(y_test), 4096):
            logits = net(x_test[start : start + 4096])
            correct += (logits.argmax(dim=1) == y_test[start : start + 4096]).sum()
    correct_total, tested = _sum_over_ranks([correct, float(len(y_test))], device, ranks)
    accuracy = correct_total / tested
    ctx.log(params.epochs, **{"accuracy/test": accuracy})

    checkpoint = None
    if rank == 0:
        ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = ctx.artifacts_dir / f"{ctx.device}-{params.model.value}.safetensors"
        state = {key: value.detach().cpu().contiguous() for key, value in net.state_dict().items()}
        save_file(state, str(checkpoint), metadata={
            "model": params.model.value, "dataset": split.name, "epochs": str(params.epochs),
            "features": str(split.features), "classes": str(split.classes), "hidden": str(params.hidden),
        })
    logger.info("%s: %s on %s, accuracy %.4f in %.2f s", ctx.device, params.model.value, split.name,
                accuracy, train_s)
    samples_seen = rank_samples * (params.epochs - resumed_from)
    # The first numeric fields are what `devicefleet run` shows in its table.
    return {
        "accuracy": accuracy,
        "loss": epoch_loss,
        "samples_per_s": samples_seen / train_s if train_s > 0 else None,
        "data_wait_fraction": wait_s / train_s if train_s > 0 else None,
        "model": params.model.value,
        "dataset": split.name,
        "epochs": params.epochs,
        "train_samples": n_train,
        "samples_seen": samples_seen,
        "test_samples": len(split.y_test),
        "resumed_from_epoch": resumed_from,
        "train_s": train_s,
        "num_workers": workers,
        # Where the training data lived: "device" (indexed there) or "loader", and why.
        "data_path": asdict(placement),
        "torch_device": str(device),
        "parallel": asdict(parallel),
        # Rank 0's file (the other ranks of a distributed job write none: theirs is None).
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "weights_digest": weights_digest(net),
        # Per-epoch training loss and accuracy (on the training batches) of this run's epochs.
        "history": history,
    }
