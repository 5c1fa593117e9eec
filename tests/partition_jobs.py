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
