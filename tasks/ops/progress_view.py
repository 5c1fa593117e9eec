"""Progress, as people see it: one live rich bar per device of a running fan-out.

Jobs report with ``ctx.progress(epoch=3, epochs=15, loss=0.21)`` (published by
:mod:`tasks.worker.progress`); a bar fills from the first counter pair it finds in the fields
(:data:`COUNTERS`), and shows the other scalar fields as text.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ..core.defaults import VIEW_REFRESH_S

logger = logging.getLogger(__name__)

#: Field pairs ``(done, total)`` a job may report, in the order they are looked for.
COUNTERS = (("epoch", "epochs"), ("step", "total"), ("step", "steps"), ("done", "total"))


def fraction(fields: dict[str, Any]) -> tuple[float, float] | None:
    """``(done, total)`` from progress fields, or None when they carry no counter."""
    for done, total in COUNTERS:
        a, b = fields.get(done), fields.get(total)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
            return float(a), float(b)
    return None


def describe(fields: dict[str, Any]) -> str:
    """A short text of the fields that are not counters, e.g. ``loss=0.213``."""
    skip = {"device"} | {name for pair in COUNTERS for name in pair}
    parts = []
    for key, value in fields.items():
        if key in skip or isinstance(value, (dict, list)):
            continue
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def watch(handle: Any, console: Console, interval_s: float = VIEW_REFRESH_S, timeout: float | None = None) -> None:
    """Draw one progress bar per device of ``handle`` (a FanOut) until every device is done.

    Returns when the fan-out is ready or ``timeout`` seconds passed; the caller then calls
    ``handle.get``, which raises the timeout.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    columns = (
        TextColumn("[bold]{task.fields[device]:>6}"),
        BarColumn(),
        TextColumn("{task.fields[count]:>9}"),
        TextColumn("{task.fields[state]:<8}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bars:
        ids: dict[str, TaskID] = {
            device: bars.add_task(device, total=None, device=device, state="PENDING", info="",
                                    count="")
            for device in handle.devices
        }
        while True:
            # Read readiness first: the bars drawn below then show every end it saw (reading it
            # after the states could return on an end the bars never drew).
            done = handle.ready()
            states = handle.states()
            progress = handle.progress()
            for device, task_id in ids.items():
                state = states.get(device, "PENDING")
                fields = progress.get(device) or {}
                counter = fraction(fields)
                update: dict[str, Any] = {"state": state}
                if fields:
                    update["info"] = describe(fields)
                if counter is not None:
                    update.update(completed=counter[0], total=counter[1],
                                  count=f"{counter[0]:g}/{counter[1]:g}")
                if state in ("SUCCESS", "FAILURE"):
                    total = bars.tasks[task_id].total or 1
                    update.update(total=total, completed=total)
                bars.update(task_id, **update)
            if done or (deadline is not None and time.monotonic() > deadline):
                return
            time.sleep(interval_s)
