"""Jobs for the tests only, allowlisted in the test fleet (never in a real one)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from tasks.job import JobContext, job


class FailParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str = "boom"


@job("fail", params=FailParams)
def fail(ctx: JobContext, params: FailParams) -> dict[str, Any]:
    """Raise ValueError(message): a job that fails on purpose."""
    raise ValueError(params.message)


class EchoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: Any = None


@job("echo", params=EchoParams)
def echo(ctx: JobContext, params: EchoParams) -> dict[str, Any]:
    """Return the value, the device and the pid: a no-op job."""
    return {"value": params.value, "device": ctx.device, "pid": os.getpid()}
