"""A job module that is NOT on any allowlist. Importing it leaves a marker file, so a test can
prove that no message made a worker import it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks.core.job import JobContext, job

_marker = os.environ.get("DFTEST_IMPORT_MARKER")
if _marker:
    Path(_marker).write_text("imported")


class NoParams(BaseModel):
    pass


@job("forbidden", params=NoParams)
def forbidden(ctx: JobContext, params: NoParams) -> dict[str, Any]:
    return {"ran": True}
