"""Result tables, drawn in one place (tasks/ops/result_table.py): each status as what it is."""

from __future__ import annotations

from rich.console import Console

from tasks.ops.result_table import fanout_table, ranked_table, status_text
from tasks.ops.sweep_view import sweep_rows


def _entry(device: str, status: str, error: dict | None = None, output: dict | None = None) -> dict:
    return {"device": device, "worker": f"{device}@host", "slot": 0, "status": status, "output": output,
            "error": error, "started_at": None, "finished_at": None, "duration_s": 0.5,
            "visibility": {"cuda_visible_devices": "-1"}}


def _text(renderable: object) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_cancelled_entry_reads_cancelled_not_error():
    table, below = fanout_table({
        "cpu0": _entry("cpu0", "ok", output={"accuracy": 0.96}),
        "cpu1": _entry("cpu1", "cancelled", error={"type": "JobCancelled", "message": "stopped at ctx.progress()"}),
        "gpu0": _entry("gpu0", "error", error={"type": "OutOfMemory", "message": "CUDA out of memory"}),
    })
    rows = {line.split()[0]: line.split()[1] for line in _text(table).splitlines()
            if line.strip().startswith(("cpu", "gpu"))}
    assert rows == {"cpu0": "ok", "cpu1": "cancelled", "gpu0": "error"}
    assert below == []
    assert status_text("cancelled") == "[yellow]cancelled[/]" and status_text("error") == "[red]error[/]"


def test_the_ranked_table_draws_statuses_the_same_way():
    entries = [{**_entry("cpu0", "ok", output={"score": 0.9}), "trial": 0, "kwargs": {"lr": 0.1}},
               {**_entry("cpu1", "cancelled"), "trial": 1, "kwargs": {"lr": 0.2}}]
    text = _text(ranked_table(sweep_rows(entries, "score"), "score"))
    assert "cancelled" in text and "error" not in text
