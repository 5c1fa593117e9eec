"""``train``: train a real model on a real dataset and save a safetensors checkpoint.

The loop follows the habits that keep a device fed (PyTorch's Performance Tuning Guide,
https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html): DataLoader workers prefetch
batches in the background; on CUDA, batches are pinned and copied with ``non_blocking=True``;
accumulators live on the device and are read once per epoch (no per-step ``.item()``);
evaluation runs under ``torch.inference_mode()``. Results travel by reference: the checkpoint
stays on disk and only its path goes through Redis.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

from ..core.errors import TrainingDiverged
from ..core.job import JobContext, JobMetric, job
from . import data, resume
from .loader import build_loader
from .models import ModelName, build

logger = logging.getLogger(__name__)


class TrainParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelName = ModelName.MLP
    #: ``digits`` (scikit-learn's, shipped with the package) or a path to an ``.npz`` file.
    dataset: str = Field(default="digits", min_length=1)
    epochs: int = Field(default=20, ge=1, le=100_000)
    batch_size: int = Field(default=64, ge=1, le=1_000_000)
    lr: float = Field(default=3e-3, gt=0, le=10)
    hidden: int = Field(default=128, ge=1, le=65_536)
    #: DataLoader worker processes; ``auto``: 4 on a GPU, else one per core beyond the first.
    num_workers: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"
    seed: int = 0
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    #: Save a resumable checkpoint (model + optimizer) at most this often; 0: every epoch.
    #: A job that runs again after its worker died resumes from it.
    checkpoint_every_s: float = Field(default=10.0, ge=0)


def _loader_workers(params: TrainParams, ctx: JobContext, cuda: bool) -> int:
    if params.num_workers != "auto":
        return params.num_workers
    cores = len(ctx.cores) or 1
    return min(4, cores) if cuda else min(4, cores - 1)


@job("train", params=TrainParams, metrics={
    "samples_seen": JobMetric.SAMPLES,
    "samples_per_s": JobMetric.SAMPLES_PER_S,
    "data_wait_fraction": JobMetric.DATA_WAIT_FRACTION,
})
def train(ctx: JobContext, params: TrainParams) -> dict[str, Any]:
    """Train ``model`` on ``dataset`` for ``epochs``; returns metrics and a checkpoint path."""
    torch.manual_seed(params.seed)
    device = torch.device(ctx.torch_device)
    cuda = device.type == "cuda"
    split = data.load(params.dataset, test_fraction=params.test_fraction, seed=params.seed)
    workers = _loader_workers(params, ctx, cuda)
    loader = build_loader(
        TensorDataset(split.x_train, split.y_train),
        batch_size=params.batch_size,
        num_workers=workers,
        cuda=cuda,
        shuffle=True,
        seed=params.seed,
    )
    model = build(params.model, split.features, split.classes, params.hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=params.lr)
    loss_fn = nn.CrossEntropyLoss()
    n_train = len(split.y_train)

    resumed_from = resume.load(ctx.artifacts_dir, model, optimizer, device)
    last_save = time.monotonic()

    wait_s = 0.0
    epoch_loss = math.nan
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    for epoch in range(resumed_from + 1, params.epochs + 1):
        model.train()
        epoch_started = time.perf_counter()
        epoch_wait = wait_s
        loss_sum = torch.zeros((), device=device)
        correct_sum = torch.zeros((), dtype=torch.long, device=device)
        batches = iter(loader)
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
        # One device-to-host read per epoch, for the loss curve and progress.
        epoch_loss = float(loss_sum.item()) / n_train
        epoch_accuracy = int(correct_sum.item()) / n_train
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
            "samples_per_s": n_train / epoch_s if epoch_s > 0 else 0.0,
            "data_wait_fraction": (wait_s - epoch_wait) / epoch_s if epoch_s > 0 else 0.0,
        })
        ctx.progress(epoch=epoch, epochs=params.epochs, loss=round(epoch_loss, 6))
        if epoch < params.epochs and time.monotonic() - last_save >= params.checkpoint_every_s:
            resume.save(ctx.artifacts_dir, model, optimizer, epoch, {"loss": epoch_loss})
            last_save = time.monotonic()
    train_s = time.perf_counter() - started

    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    with torch.inference_mode():
        x_test = split.x_test.to(device, non_blocking=True)
        y_test = split.y_test.to(device, non_blocking=True)
        for start in range(0, len(y_test), 4096):
            logits = model(x_test[start : start + 4096])
            correct += (logits.argmax(dim=1) == y_test[start : start + 4096]).sum()
    accuracy = int(correct.item()) / len(split.y_test)
    ctx.log(params.epochs, **{"accuracy/test": accuracy})

    ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = ctx.artifacts_dir / f"{ctx.device}-{params.model.value}.safetensors"
    state = {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items()}
    save_file(state, str(checkpoint), metadata={
        "model": params.model.value, "dataset": split.name, "epochs": str(params.epochs),
        "features": str(split.features), "classes": str(split.classes), "hidden": str(params.hidden),
    })
    logger.info("%s: %s on %s, accuracy %.4f in %.2f s", ctx.device, params.model.value, split.name,
                accuracy, train_s)
    samples_seen = n_train * (params.epochs - resumed_from)
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
        "torch_device": str(device),
        "checkpoint": str(checkpoint),
        # Per-epoch training loss and accuracy (on the training batches) of this run's epochs.
        "history": history,
    }
