"""Jobs that misbehave on purpose, for the ``isolation`` benchmark (:mod:`.isolation`) only.

The bench fleet allowlists this module beside ``tasks.jobs`` (see :mod:`.run`); no other fleet
does, and the built-in jobs never include these:

- ``segfault``: after ``delay_s``, writes ``{"t": time.time(), "pid": ...}`` to ``<marker_dir>/<job id>.json``, then
  kills its own process with SIGSEGV, as a crash in native code (a CUDA kernel, a C extension)
  would;
- ``hang``: writes the same start line, then sleeps and never calls ``ctx.progress()``, so only
  its process being ended stops it before ``seconds``;
- ``stamp``: returns the time it started and its pid, to time when a device took its next job.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.job import JobContext, job


class MarkedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A folder the bench reads: the job writes ``<job id>.json`` there before it misbehaves.
    marker_dir: str


class SegfaultParams(MarkedParams):
    #: Seconds to wait before crashing (the bench queues the next job meanwhile).
    delay_s: float = Field(default=0.0, ge=0, le=60)


class HangParams(MarkedParams):
    #: The job ends by itself after this long if nothing ends it first.
    seconds: float = Field(default=120.0, gt=0, le=3600)


class StampParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _mark(ctx: JobContext, marker_dir: str) -> None:
    """Write ``{"t", "pid"}`` to ``<marker_dir>/<job id>.json``, atomically (the bench polls it)."""
    path = Path(marker_dir) / f"{ctx.job_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"t": time.time(), "pid": os.getpid()}))
    tmp.replace(path)


@job("segfault", params=SegfaultParams)
def segfault(ctx: JobContext, params: SegfaultParams) -> dict[str, Any]:
    """Wait ``delay_s``, then kill this job process with SIGSEGV; never returns."""
    time.sleep(params.delay_s)
    # No core file: dumping a process that has imported torch takes seconds (more where
    # systemd-coredump collects it), which is the host's policy, not the fleet's recovery.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _mark(ctx, params.marker_dir)
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # the signal is delivered before this returns
    raise RuntimeError("SIGSEGV did not end the job process")


@job("hang", params=HangParams)
def hang(ctx: JobContext, params: HangParams) -> dict[str, Any]:
    """Sleep ``seconds`` without ever calling ``ctx.progress()`` (so a cancel cannot reach it)."""
    _mark(ctx, params.marker_dir)
    deadline = time.monotonic() + params.seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return {"hung_s": params.seconds}


@job("stamp", params=StampParams)
def stamp(ctx: JobContext, params: StampParams) -> dict[str, Any]:
    """Return ``{"started": time.time(), "pid": ...}`` taken as the job starts."""
    return {"started": time.time(), "pid": os.getpid(), "device": ctx.device}
