"""Result tables, drawn in one place: a fan-out's ``{device: entry}`` (``devicefleet run``,
``demo``) and a sweep's or study's trials ranked by their objective (``devicefleet sweep``,
``optimize``).

A job's status is drawn by :func:`status_text` in both: ``ok`` green, ``cancelled`` yellow (a
cancelled job did not fail), anything else (``error``, an Optuna trial's ``fail``) red.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from ..core.records import Entry, EntryStatus
from .status import table as fit_table

logger = logging.getLogger(__name__)

#: Rows of the ranked table (the best ones); the JSON output has every trial.
TABLE_ROWS = 20
#: The result table shows this many numeric output fields, the first ones in the job's output
#: (a job puts first what matters most); the other scalar fields follow as text.
SUMMARY_FIELDS = 4
#: Text fields longer than this (paths, ids) are listed under the table, not in it.
LONG_TEXT = 32

#: Styles of the statuses that are not failures: entries' and Optuna trials' (``complete``,
#: ``pruned``, ``running``).
_STYLES = {EntryStatus.OK.value: "green", "complete": "green", EntryStatus.CANCELLED.value: "yellow",
           "pruned": "yellow", "running": "cyan"}


def status_text(status: str) -> str:
    """``status`` with its colour as rich markup (red for anything that is a failure)."""
    return f"[{_STYLES.get(status, 'red')}]{status}[/]"


def fmt(value: Any) -> str:
    """A cell's text: large floats with thousands separators, small ones to 3 figures."""
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
    return str(value)


def fanout_table(results: Mapping[str, Mapping[str, Any]]) -> tuple[Table, list[str]]:
    """The table of a fan-out's ``{device: entry}``, and the lines to print under it (long
    text fields)."""
    entries = {device: Entry.parse(entry) for device, entry in results.items()}
    outputs = [entry.output or {} for entry in entries.values() if entry.ok]
    numeric: list[str] = []
    for out in outputs:
        for key, value in out.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in numeric:
                numeric.append(key)
    metrics = numeric[:SUMMARY_FIELDS]
    # The text column only when a device did not succeed or the output has no numeric field to show.
    other = any(not entry.ok for entry in entries.values()) or not metrics
    headers = [key.replace("_", " ") for key in metrics]
    table = fit_table("fan-out result",
                      ["device", "status", "seconds", "CUDA visible", *headers]
                      + (["output / error"] if other else []),
                      right=("seconds", *headers))
    below: list[str] = []
    for device, entry in results.items():
        output = entry.get("output") or {}
        vis = entry.get("visibility") or {}
        ok = entries[device].ok
        row = [device, status_text(entries[device].status.value), fmt(entry.get("duration_s")),
               str(vis.get("cuda_visible_devices"))]
        row += [fmt(output.get(key, "")) for key in metrics]
        if ok:
            short = []
            for key, value in output.items():
                if key in metrics or isinstance(value, (dict, list)):
                    continue
                if isinstance(value, str) and len(value) > LONG_TEXT:
                    below.append(f"{device} {key}: {value}")
                else:
                    short.append(f"{key}={fmt(value)}")
            if other:
                row.append(", ".join(short[:SUMMARY_FIELDS]))
        else:
            error = entry.get("error") or {}
            row.append(f"{error.get('type')}: {error.get('message')}")
        table.add_row(*row)
    return table, below


def ranked_table(rows: Sequence[Mapping[str, Any]], objective: str | None, direction: str = "maximize",
                 limit: int = TABLE_ROWS) -> Table:
    """Finished trials best first by ``objective`` (those without it last, in trial order).

    Each row: ``trial``, ``status``, ``device``, ``objective``, ``params`` (a dict) and
    ``duration_s``.
    """
    sign = -1.0 if direction == "maximize" else 1.0

    def key(row: Mapping[str, Any]) -> tuple[int, float, int]:
        value = row.get("objective")
        return (0, sign * value, row["trial"]) if value is not None else (1, 0.0, row["trial"])

    ordered = sorted(rows, key=key)
    title = f"best {min(limit, len(rows))} of {len(rows)} trials" + (f" by {objective}" if objective else "")
    table = Table(title=title)
    for column in ("rank", "trial", "status", "device", objective or "objective", "duration", "kwargs"):
        table.add_column(column, overflow="fold")
    # (the ranked table keeps its boxed look: `devicefleet sweep`'s output the README shows)
    for rank, row in enumerate(ordered[:limit], start=1):
        value = row.get("objective")
        duration = row.get("duration_s")
        table.add_row(str(rank), str(row["trial"]), status_text(str(row["status"])), str(row.get("device") or "-"),
                      "-" if value is None else f"{value:.4g}",
                      "-" if duration is None else f"{duration:.2f}s", params_text(row.get("params") or {}))
    return table



def params_text(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
