"""Jobs for the partition tests only (tests/partition_rig.py), allowlisted on the rig's workers."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tasks.core.job import JobContext, job

#: How often a ``tick`` run marks that it is alive: overlaps are measured to this resolution.
TICK_S = 0.25


class TickParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: How long the run ticks.
    seconds: float = Field(ge=0, le=600)
    #: A folder shared by every host (namespaces share the filesystem): each run appends one
    #: line per tick to ``<marker>/<job id>``.
    marker: str
    #: A name the test gives the trial (``long``, ``short``...), echoed in the output.
    label: str = ""


@job("tick", params=TickParams)
def tick(ctx: JobContext, params: TickParams) -> dict[str, Any]:
    """Tick every :data:`TICK_S` for ``seconds``, appending ``{device, job, run, pid, t}`` (``run``
    a token of this run: a job process may run several; ``t`` wall time, comparable across
    hosts) to ``marker/<job id>`` at each tick, the first at once and the last at the end;
    return which run this was and when it started."""
    path = Path(params.marker) / ctx.job_id
    pid = os.getpid()
    run = uuid.uuid4().hex
    started = time.time()

    def mark() -> None:
        with open(path, "a") as handle:  # one short line per write: appends do not interleave
            handle.write(json.dumps({"device": ctx.device, "job": ctx.job_id, "run": run, "pid": pid,
                                     "t": time.time()}) + "\n")

    mark()
    deadline = time.monotonic() + params.seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(TICK_S, left))
        mark()
    return {"device": ctx.device, "run": run, "pid": pid, "started": started, "label": params.label}


class GangTickParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: How long generation 0 ticks (the gang is cut off in it), and every later one.
    seconds: float = Field(ge=0, le=600)
    restarted_seconds: float = Field(ge=0, le=600)
    marker: str


@job("gang_tick", params=GangTickParams)
def gang_tick(ctx: JobContext, params: GangTickParams) -> dict[str, Any]:
    """A rank of a distributed job that sums over its gang every :data:`TICK_S`, appending ``{device,
    job, run, pid, gen, t}`` to ``marker/<job id>`` after each sum (the first before any), for
    ``seconds`` in generation 0 and ``restarted_seconds`` in any later one."""
    import torch
    import torch.distributed as dist

    assert ctx.distributed is not None, "gang_tick is a distributed job: fan_out(..., distributed=True)"
    gen = ctx.distributed.restarts
    path = Path(params.marker) / ctx.job_id
    pid, run = os.getpid(), uuid.uuid4().hex

    def mark() -> None:
        with open(path, "a") as handle:
            handle.write(json.dumps({"device": ctx.device, "job": ctx.job_id, "run": run, "pid": pid, "gen": gen,
                                     "t": time.time()}) + "\n")

    mark()
    deadline = time.monotonic() + (params.seconds if gen == 0 else params.restarted_seconds)
    total = torch.zeros(1)
    while time.monotonic() < deadline:
        value = torch.ones(1)
        dist.all_reduce(value, group=ctx.process_group)
        total += value
        mark()
        time.sleep(TICK_S)
    return {"device": ctx.device, "run": run, "pid": pid, "sum": float(total.item())}
