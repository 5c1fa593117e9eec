"""Resumable training: periodic checkpoints of model and optimizer, and resuming from one.

A job that runs again after its worker died has the same job id, hence the same
``ctx.artifacts_dir``; :func:`load` finds the last checkpoint there. Tensors go to
``resume.safetensors`` (model ``model.<name>``, optimizer state ``optim.<param>.<key>``); the
epoch and the optimizer's hyper-parameters to ``resume.json``. Both are written to a temporary
name and renamed, so a kill during a save leaves the previous checkpoint intact.

In a distributed job only rank 0 saves; when the gang (re)starts, :func:`share` copies rank 0's
checkpoint files to every rank over the process group (as bytes: no pickle, and no shared
filesystem needed across hosts), so every rank resumes from the same epoch and state.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

TENSORS = "resume.safetensors"
INFO = "resume.json"


def save(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
         extra: dict[str, Any] | None = None) -> None:
    """Checkpoint ``model`` and ``optimizer`` after ``epoch`` (1-based) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, param_state in state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    info = {"epoch": epoch, "param_groups": state["param_groups"], "scalars": scalars,
            **(extra or {})}
    tmp_tensors = folder / (TENSORS + ".tmp")
    save_file(tensors, str(tmp_tensors))
    os.replace(tmp_tensors, folder / TENSORS)
    tmp_info = folder / (INFO + ".tmp")
    tmp_info.write_text(json.dumps(info))
    os.replace(tmp_info, folder / INFO)


def share(folder: Path, rank: int, device: torch.device) -> None:
    """Make ``folder`` on every rank hold rank 0's checkpoint (or none, if rank 0 has none).

    A collective: every rank of the default process group calls it.
    """
    import torch.distributed as dist

    names = (TENSORS, INFO)
    blobs = [(folder / name).read_bytes() if rank == 0 and (folder / name).is_file() else b"" for name in names]
    if rank == 0 and not all(blobs):
        blobs = [b"", b""]
    sizes = torch.tensor([len(blob) for blob in blobs], dtype=torch.long, device=device)
    dist.broadcast(sizes, src=0)
    for name, blob, size in zip(names, blobs, sizes.tolist(), strict=True):
        path = folder / name
        if not size:
            if rank != 0:
                path.unlink(missing_ok=True)
            continue
        data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device) if rank == 0
                else torch.empty(int(size), dtype=torch.uint8, device=device))
        dist.broadcast(data, src=0)
        if rank != 0:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / (name + ".tmp")
            tmp.write_bytes(data.cpu().numpy().tobytes())
            os.replace(tmp, path)


def load(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the checkpoint in ``folder``, if any; returns the last finished epoch (0: none)."""
    info_path, tensors_path = folder / INFO, folder / TENSORS
    if not (info_path.is_file() and tensors_path.is_file()):
        return 0
    try:
        info = json.loads(info_path.read_text())
        # Read onto the host: load_state_dict copies the model's tensors to its device and the
        # optimizer's moments to their parameters', and keeps Adam's step counts where they are,
        # on the host (on the GPU each step would read them back: a sync per parameter per step).
        tensors = load_file(str(tensors_path))
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict[Any, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        for index, values in info.get("scalars", {}).items():
            state.setdefault(int(index), {}).update(values)
        optimizer.load_state_dict({"state": state, "param_groups": info["param_groups"]})
        epoch = int(info["epoch"])
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        # A checkpoint that does not fit (another model, a torn file): start over, say so.
        logger.warning("cannot resume from %s (%s); starting from epoch 1", folder, exc)
        return 0
    logger.info("resuming from %s after epoch %d", folder, epoch)
    return epoch
