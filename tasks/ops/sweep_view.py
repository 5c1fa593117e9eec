"""Sweeps and studies, as people see them: a live summary while they run, a ranked table at the end.

The live view (:func:`watch_sweep`, :class:`StudyView`) shows done / running / queued (and
failed, cancelled or pruned), each device's finished and running trials, and the best objective
so far; :func:`tasks.ops.result_table.ranked_table` ranks the finished trials by the objective.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..core.commands import CommandParams
from ..core.defaults import VIEW_REFRESH_S
from .result_table import params_text, ranked_table

__all__ = ["StudyView", "best_entry", "objective_of", "ranked_table", "study_rows", "sweep_rows", "watch_sweep"]

logger = logging.getLogger(__name__)



def objective_of(entry: Mapping[str, Any], objective: str | None) -> float | None:
    """The entry's objective as a number, or None (failed, or no such number field)."""
    value = (entry.get("output") or {}).get(objective) if objective else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def best_entry(entries: Sequence[Mapping[str, Any] | None], objective: str | None,
               direction: str = "maximize") -> Mapping[str, Any] | None:
    """The finished entry with the best objective (None if none has it)."""
    scored = [(v, e) for e in entries if e is not None and (v := objective_of(e, objective)) is not None]
    if not scored:
        return None
    pick = max if direction == "maximize" else min
    return pick(scored, key=lambda pair: pair[0])[1]


def summary_view(title: str, counts: Mapping[str, int], devices: Mapping[str, Mapping[str, int]],
                 best: str | None) -> Group:
    """The live summary: a counts line, a per-device table and the best so far."""
    line = Text(title + "  ", style="bold")
    line.append("  ".join(f"{name} {value}" for name, value in counts.items()))
    table = Table("device", "done", "running", box=None, pad_edge=False)
    for device, values in sorted(devices.items()):
        table.add_row(device, str(values.get("done", 0)), str(values.get("running", 0)))
    parts: list[Any] = [line, table]
    if best:
        parts.append(Text(f"best so far: {best}"))
    return Group(*parts)


def _sweep_view(handle: Any, objective: str | None, direction: str) -> Group:
    metas = handle.poll()
    s = handle.summary(metas)
    counts = {"done": s.done, "running": s.running, "queued": s.queued}
    counts.update({k: v for k, v in (("failed", s.failed), ("cancelled", s.cancelled)) if v})
    best = best_entry(handle.entries(metas), objective, direction)
    text = None
    if best is not None:
        text = f"{objective}={objective_of(best, objective):.4g} (trial {best['trial']}, {_kwargs_text(best)})"
    return summary_view(f"sweep {handle.id} ({s.finished}/{s.total})", counts, s.devices, text)


def watch_sweep(handle: Any, console: Console, *, objective: str | None = None, direction: str = "maximize",
                interval_s: float = VIEW_REFRESH_S, timeout: float | None = None) -> None:
    """Redraw the sweep's summary until every trial has finished or ``timeout`` passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with Live(_sweep_view(handle, objective, direction), console=console, transient=False,
              auto_refresh=False) as live:
        while not handle.ready():
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(interval_s)
            live.update(_sweep_view(handle, objective, direction), refresh=True)
        live.update(_sweep_view(handle, objective, direction), refresh=True)


class StudyView:
    """The live summary of an optimize run; pass it as ``on_update`` (redraws 4 times a second)."""

    def __init__(self, console: Console, objective: str, interval_s: float = VIEW_REFRESH_S) -> None:
        self.objective = objective
        self.interval_s = interval_s
        self._last = 0.0
        self._live = Live(Text(""), console=console, transient=False, auto_refresh=False)

    def __enter__(self) -> StudyView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.__exit__(*exc)

    def __call__(self, progress: Any) -> None:
        if time.monotonic() - self._last < self.interval_s and progress.finished < progress.n_trials:
            return
        self._last = time.monotonic()
        running = [d for d in progress.running.values() if d]
        counts = {"complete": progress.complete, "running": len(running),
                  "queued": len(progress.running) - len(running)}
        counts.update({k: v for k, v in (("pruned", progress.pruned), ("failed", progress.failed)) if v})
        devices = {d: {"done": n, "running": running.count(d)} for d, n in progress.devices.items()}
        for device in running:
            devices.setdefault(device, {"done": 0, "running": running.count(device)})
        best = None
        if progress.best_value is not None:
            best = f"{self.objective}={progress.best_value:.4g} ({params_text(progress.best_params or {})})"
        self._live.update(summary_view(f"study {progress.name} ({progress.finished}/{progress.n_trials})",
                                       counts, devices, best), refresh=True)


def sweep_rows(entries: Sequence[Mapping[str, Any]], objective: str | None) -> list[dict[str, Any]]:
    """:func:`ranked_table` rows of a sweep's entries."""
    return [{"trial": e["trial"], "status": e["status"], "device": e.get("device"),
             "objective": objective_of(e, objective), "params": _trial_params(e.get("kwargs") or {}),
             "duration_s": e.get("duration_s")} for e in entries]


def study_rows(study: Any) -> list[dict[str, Any]]:
    """:func:`ranked_table` rows of an Optuna study's trials."""
    return [{"trial": t.number, "status": t.state.name.lower(), "device": t.user_attrs.get("device"),
             "objective": t.value if t.value is not None and t.state.name == "COMPLETE" else None,
             "params": t.params, "duration_s": t.duration.total_seconds() if t.duration else None}
            for t in study.trials]


def _kwargs_text(entry: Mapping[str, Any]) -> str:
    return params_text(_trial_params(entry.get("kwargs") or {}))


def _trial_params(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """What tells a trial from the others: its kwargs, or a command's parameters only (not the
    argv, folder and env every trial shares)."""
    if isinstance(kwargs.get("argv"), list):
        return {k: v for k, v in kwargs.items() if k not in CommandParams.model_fields}
    return kwargs
