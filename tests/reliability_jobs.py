"""Jobs for the reliability tests only, allowlisted in their fleet (never in a real one)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from tasks.core.job import JobContext, job


class SleepParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(ge=0, le=600)
    #: A folder where each run appends its start and end, to count runs and check overlaps.
    marker: str
    #: Fail with ValueError(fail) after the end line (a job whose task ends in FAILURE).
    fail: str | None = None


@job("sleepy", params=SleepParams)
def sleepy(ctx: JobContext, params: SleepParams) -> dict[str, Any]:
    """Sleep, writing ``start``/``end`` lines (with the pid) to ``marker/<job id>``; then fail if
    ``fail`` is set."""
    path = Path(params.marker) / ctx.job_id
    with open(path, "a") as handle:
        handle.write(json.dumps({"event": "start", "pid": os.getpid(), "t": time.time()}) + "\n")
    time.sleep(params.seconds)
    with open(path, "a") as handle:
        handle.write(json.dumps({"event": "end", "pid": os.getpid(), "t": time.time()}) + "\n")
    if params.fail is not None:
        raise ValueError(params.fail)
    return {"pid": os.getpid(), "worker_pid": os.getppid()}


class OomParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Really allocate this much on the device (a GPU's real OOM); None: raise torch's error.
    allocate_gib: float | None = Field(default=None, gt=0)


@job("oom", params=OomParams)
def oom(ctx: JobContext, params: OomParams) -> dict[str, Any]:
    """Run out of memory (really, or by raising torch's error), unless this run is a CPU fallback."""
    if ctx.fallback_from is None:
        if params.allocate_gib is not None:
            block = torch.empty(int(params.allocate_gib * 2**30), dtype=torch.uint8,
                                device=ctx.torch_device)
            return {"allocated": block.numel()}
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test)")
    return {"torch_device": ctx.torch_device, "fallback_from": ctx.fallback_from, "pid": os.getpid()}


class KillWorkerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A folder where each run appends a line (with its worker's pid) before it kills the worker.
    marker: str


@job("kill_worker", params=KillWorkerParams)
def kill_worker(ctx: JobContext, params: KillWorkerParams) -> dict[str, Any]:
    """Take the whole worker down, as a job that makes the machine OOM-kill its worker would:
    SIGKILL the worker (the job process's parent), after a line in ``marker/<job id>``."""
    worker = os.getppid()
    with open(Path(params.marker) / ctx.job_id, "a") as handle:
        handle.write(json.dumps({"event": "start", "pid": os.getpid(), "worker_pid": worker, "t": time.time()}) + "\n")
    os.kill(worker, signal.SIGKILL)
    time.sleep(60)  # the job process dies with its worker (PR_SET_PDEATHSIG)
    return {"survived": True}
