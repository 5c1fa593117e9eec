"""``probe``: report what the worker sees, and optionally keep its device busy for a while."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.devices import usable_cores, visibility
from ..core.job import JobContext, job


class ProbeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Seconds to keep the device busy (0: report and return at once).
    busy_s: float = Field(default=0.0, ge=0, le=86_400)
    #: ``compute``: matrix products on the device; ``sleep``: idle wait (no compute).
    mode: Literal["compute", "sleep"] = "compute"
    #: Side of the square matrices multiplied while busy.
    size: int = Field(default=256, ge=8, le=16_384)
    #: Reports while busy: ``ctx.progress(step=i, steps=steps, value=score * i / steps)`` after
    #: each of ``steps`` equal slices of ``busy_s`` (a trial with intermediate values).
    steps: int = Field(default=0, ge=0, le=100_000)
    #: Returned as ``score``: a sweep trial's objective, known in advance.
    score: float = 0.0


@job("probe", params=ProbeParams)
def probe(ctx: JobContext, params: ProbeParams) -> dict[str, Any]:
    """Report env, torch's view, host and pid; keep the device busy for ``busy_s`` seconds
    (reporting ``steps`` times on the way, if asked); return ``score`` as given."""
    started = time.time()
    iterations = 0
    if params.steps:
        for step in range(1, params.steps + 1):
            iterations += _busy(ctx, params.busy_s / params.steps, params)
            ctx.progress(step=step, steps=params.steps, value=params.score * step / params.steps)
    elif params.busy_s > 0:
        iterations = _busy(ctx, params.busy_s, params)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        # The job runs in a job process; its parent is the device's worker.
        "worker_pid": os.getppid(),
        "device": ctx.device,
        "torch_device": ctx.torch_device,
        "env": {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")},
        "torch": visibility(),
        "affinity": usable_cores(),
        "python": platform.python_version(),
        "argv0": os.path.basename(sys.argv[0]) if sys.argv else None,
        "busy_s": params.busy_s,
        "mode": params.mode,
        "iterations": iterations,
        "score": params.score,
        "window": [started, time.time()],
    }


def _busy(ctx: JobContext, seconds: float, params: ProbeParams) -> int:
    """Keep the device busy for ``seconds`` as ``params.mode`` says; returns the iterations."""
    iterations = 0
    if seconds > 0:
        deadline = time.perf_counter() + seconds
        if params.mode == "sleep":
            time.sleep(seconds)
        else:
            import torch

            device = torch.device(ctx.torch_device)
            a = torch.rand(params.size, params.size, device=device)
            b = torch.rand(params.size, params.size, device=device)
            while time.perf_counter() < deadline:
                for _ in range(8):
                    a = torch.tanh(a @ b)
                iterations += 8
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    return iterations
