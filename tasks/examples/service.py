"""An example web service in front of the fleet: start a fan-out or a sweep, stream its
progress to a browser as server-sent events, return its result.

::

    pip install 'devicefleet[service]'
    DEVICEFLEET_REDIS_URL=redis://:PASSWORD@127.0.0.1:6379/0 uvicorn tasks.examples.service:app

=================================  ======================================================
``POST /runs``                     start: ``{"job": "train", "devices": "all", "kwargs": {...}}``
                                   (a fan-out), or with ``"trials": [{...}, ...]`` (a sweep);
                                   202 with the run's ``id``
``GET /runs/{id}/events``          its progress as server-sent events: ``state`` and
                                   ``progress`` events (a :class:`tasks.Report` as JSON), then
                                   ``end``
``GET /runs/{id}/result``          its result once it has finished (``?timeout=`` seconds, then
                                   504: the run goes on)
``DELETE /runs/{id}``              cancel it
``GET /status``                    the runs it knows and the event streams open now
=================================  ======================================================

Every endpoint is ``async``: one :class:`tasks.FleetClient` (made at start-up, closed at
shutdown) sends the jobs and awaits them on one pub/sub connection; no thread waits. A browser
that closes its event stream leaves the run going: another stream, or ``/result``, picks it up
(``handle.wait(cancel=True)`` would cancel it with the request instead). The runs are kept in
this process's memory, which is what an example can afford: a service of your own would keep
their ids (the handles' ``task_ids``) where it keeps its state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, JsonValue

import tasks
from tasks.core.job import PROGRESS_STATE

logger = logging.getLogger(__name__)


class RunRequest(BaseModel):
    """What to start: a fan-out of ``job`` over ``devices``, or a sweep when ``trials`` is given."""

    model_config = ConfigDict(extra="forbid")

    job: str
    devices: str | list[str] = "all"
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    trials: list[dict[str, JsonValue]] | None = None
    max_concurrent: int | None = Field(default=None, ge=1)


class Runs:
    """The service's state: its client and the runs it started."""

    def __init__(self) -> None:
        self.client = tasks.FleetClient()
        self.handles: dict[str, tasks.JobHandle[Any, Any]] = {}
        self.streams = 0

    def get(self, run_id: str) -> tasks.JobHandle[Any, Any]:
        handle = self.handles.get(run_id)
        if handle is None:
            raise HTTPException(status_code=404, detail=f"no run {run_id!r}")
        return handle


runs = Runs()


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    async with runs.client:
        yield


app = FastAPI(title="devicefleet example service", lifespan=lifespan)


@app.post("/runs", status_code=202)
async def start(request: RunRequest) -> dict[str, Any]:
    """Start a fan-out (or a sweep, with ``trials``); the send is a few blocking Redis round
    trips, so it runs in a thread."""
    try:
        if request.trials is None:
            handle: tasks.JobHandle[Any, Any] = await asyncio.to_thread(
                runs.client.fan_out, request.job, request.devices, kwargs=request.kwargs)
        else:
            handle = await asyncio.to_thread(runs.client.sweep, request.job, request.trials, request.devices,
                                             kwargs=request.kwargs, max_concurrent=request.max_concurrent)
    except tasks.DeviceFleetError as exc:  # a bad job, device or kwargs: nothing was sent
        raise HTTPException(status_code=400, detail=str(exc)) from None
    run_id = uuid.uuid4().hex
    runs.handles[run_id] = handle
    kind = "sweep" if isinstance(handle, tasks.Sweep) else "fan-out"
    logger.info("run %s: %s of %s on %s", run_id, kind, request.job, ", ".join(handle.devices))
    return {"id": run_id, "kind": kind, "devices": handle.devices}


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


@app.get("/runs/{run_id}/events")
async def events(run_id: str) -> StreamingResponse:
    """Each state and progress report of the run as it is published, then ``end``."""
    handle = runs.get(run_id)

    async def stream() -> AsyncIterator[str]:
        runs.streams += 1
        try:
            async for report in handle.watch():
                yield _event("progress" if report.state == PROGRESS_STATE else "state", report.to_dict())
            yield _event("end", {"id": run_id})
        finally:  # the run's end, or the browser went away (Starlette cancels the stream)
            runs.streams -= 1

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@app.get("/runs/{run_id}/result")
async def result(run_id: str, timeout: float = 600.0) -> dict[str, Any]:
    """The run's result (a fan-out's ``{device: entry}``, a sweep's entries), once finished."""
    handle = runs.get(run_id)
    try:
        return {"id": run_id, "result": await handle.wait(timeout=timeout)}
    except tasks.FanOutTimeout as exc:
        raise HTTPException(status_code=504, detail=str(exc)) from None


@app.delete("/runs/{run_id}")
async def cancel(run_id: str) -> dict[str, Any]:
    """Cancel the run: queued jobs never start, running ones stop at their next ``ctx.progress()``."""
    await runs.get(run_id).acancel()
    return {"id": run_id, "cancelled": True}


@app.get("/status")
async def status() -> dict[str, Any]:
    return {"runs": len(runs.handles), "streams": runs.streams}
