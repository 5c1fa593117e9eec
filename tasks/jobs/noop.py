"""``noop``: return at once. Measures what the fleet itself costs per job (``devicefleet bench``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ..core.job import JobContext, job


class NoopParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@job("noop", params=NoopParams)
def noop(ctx: JobContext, params: NoopParams) -> dict[str, Any]:
    """Do nothing; returns ``{"device": ...}``."""
    return {"device": ctx.device}
