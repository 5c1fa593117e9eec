"""Loss curves: every ``train`` run writes TensorBoard event files per device, which read back
as each device's curve and which ``devicefleet tensorboard`` serves to a real browser."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks import Fleet, fan_out
from tasks.core.errors import MissingExtra
from tasks.jobproc.scalars import ScalarLog
from tasks.ops import tensorboard as tb_server
from tasks.ops.proc import free_port, stop_process

from . import system_tools
from .browser import CHROMIUM, chromium, screenshot
from .conftest import test_env, wait_for

DEVICES = ["cpu0", "cpu1"]
EPOCHS = 4


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value)]}`` read back from a run folder with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def trained(app: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    # One model per device, each with its own seed, so the two curves differ on the page.
    handle = fan_out({device: ("train", {"epochs": EPOCHS, "num_workers": 0, "seed": seed})
                      for seed, device in enumerate(DEVICES)}, app=app)
    return handle, handle.get(timeout=180)


@pytest.mark.timeout(240)
def test_train_writes_each_devices_loss_curve_and_history(fleet: Fleet, trained: Any) -> None:
    handle, results = trained
    group = fleet.settings.tensorboard_path / f"train-{handle.group_id[:8]}"
    assert sorted(p.name for p in group.iterdir()) == DEVICES
    for device in DEVICES:
        output = results[device]["output"]
        history = output["history"]
        assert [h["epoch"] for h in history] == list(range(1, EPOCHS + 1))
        assert all(math.isfinite(h["loss"]) and 0 <= h["accuracy"] <= 1 for h in history)
        curves = scalars(group / device)
        assert {"loss/train", "accuracy/train", "samples_per_s", "data_wait_fraction",
                "accuracy/test"} <= set(curves)
        # The curve is the history, epoch by epoch (event files store float32).
        assert [s for s, _ in curves["loss/train"]] == list(range(1, EPOCHS + 1))
        assert [v for _, v in curves["loss/train"]] == pytest.approx([h["loss"] for h in history], rel=1e-5)
        assert curves["accuracy/test"] == [(EPOCHS, pytest.approx(output["accuracy"], rel=1e-5))]


@pytest.fixture(scope="module")
def served(fleet: Fleet, trained: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Its one reader is a browser: where there is none, skip (fail on CI) before starting TensorBoard.
    system_tools.tool(str(CHROMIUM), "chromium")
    port = free_port()
    log = tmp_path_factory.mktemp("tensorboard") / "tensorboard.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tasks", "tensorboard", "--logdir", str(fleet.settings.tensorboard_path),
             "--port", str(port)],
            env={**os.environ, **test_env()}, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def runs() -> list[str] | None:
        try:
            with urllib.request.urlopen(url + "/data/runs", timeout=5) as reply:
                listed: list[str] = json.loads(reply.read())
                return listed or None
        except OSError:
            return None

    try:
        wait_for(runs, 60, f"TensorBoard to list the runs (its log: {log})", poll=0.3, proc=proc)
        yield url
    finally:
        stop_process(proc, 10)


@pytest.mark.tools
@pytest.mark.timeout(180)
def test_tensorboard_serves_both_devices_curves_to_a_browser(served: str, trained: Any) -> None:
    handle, _ = trained
    with urllib.request.urlopen(served + "/data/runs", timeout=10) as reply:
        runs = json.loads(reply.read())
    expected = [f"train-{handle.group_id[:8]}/{device}" for device in DEVICES]
    assert set(expected) <= set(runs)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(served + "/?darkMode=false#timeseries", wait_until="domcontentloaded")
        page.get_by_role("combobox", name="Filter tags (regex)").fill("^loss")
        # The loss card has drawn once its data table (Run / Smoothed / Value / Step) lists both
        # devices' runs; the run selector lists them before any data has loaded.
        page.wait_for_function(
            """runs => { const text = document.body.innerText;
                         const table = text.slice(text.indexOf("Smoothed"));
                         return text.includes("Smoothed") && runs.every(r => table.includes(r)); }""",
            arg=expected, timeout=60_000,
        )
        assert "loss" in page.inner_text("body")
        page.keyboard.press("Escape")  # close the tag filter's suggestions over the card
        page.wait_for_load_state("networkidle")  # the line chart draws after its data arrives
        screenshot(page, "tensorboard-loss-curves.png")


def test_scalar_log_buffers_and_writes_on_close(tmp_path: Path) -> None:
    log = ScalarLog(tmp_path / "run")
    for step in range(500):
        log.log(step, {"loss": 1.0 / (step + 1), "lr": 0.1})
    log.close()
    assert log.points == 1000
    curves = scalars(tmp_path / "run")
    assert [s for s, _ in curves["loss"]] == list(range(500))
    assert curves["loss"][-1][1] == pytest.approx(1 / 500)
    with pytest.raises(TypeError, match=r"ctx.log\(loss='high'\)"):
        ScalarLog(tmp_path / "bad").log(0, {"loss": "high"})


def test_tensorboard_command_names_the_extra_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(MissingExtra, match=r"pip install 'devicefleet\[tensorboard\]'"):
        tb_server.command(Path("/tmp/logs"), 6006)
