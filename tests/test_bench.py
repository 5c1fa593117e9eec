"""``devicefleet bench --quick``: every figure is there and finite (the figures are not judged)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tasks.bench import report
from tasks.bench.dispatch import percentile
from tasks.bench.sweep import ideal_makespan, trial_lengths

from . import conftest


def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    with pytest.raises(ValueError, match="percentile of no values"):
        percentile([], 0.5)


def test_flatten_and_missing_keys() -> None:
    figures = {"quick": True, "dispatch": {"fanout_ms_p50": 1.0, "jobs_per_s": math.nan}}
    assert report.flatten(figures)["dispatch.fanout_ms_p50"] == 1.0
    missing = report.missing_keys(figures, gpu=False)
    assert "dispatch.jobs_per_s" in missing  # NaN is not a figure
    assert "dispatch.fanout_ms_p50" not in missing
    assert "gpu.busy_fraction" not in missing
    assert "gpu.busy_fraction" in report.missing_keys(figures, gpu=True)


def test_sweep_bounds() -> None:
    lengths = trial_lengths(40, 0.4)
    assert len(lengths) == 40 and set(lengths) <= {0.05, 0.1, 0.2, 0.4} and trial_lengths(40, 0.4) == lengths
    assert ideal_makespan([1.0, 1.0, 1.0, 1.0], 2) == 2.0  # the work spread evenly
    assert ideal_makespan([3.0, 0.5, 0.5], 2) == 3.0  # no schedule beats the longest trial


def test_goals() -> None:
    assert report.goal_met("dispatch.fanout_ms_p50", 4.0) is True
    assert report.goal_met("dispatch.jobs_per_s", 999.0) is False
    assert report.goal_met("fanout.epochs", 3) is None
    # The fleet against plain Celery in the same run: its fan-out no slower, its rate no lower.
    assert report.goal_met("dispatch.fanout_vs_plain", 0.9) is True
    assert report.goal_met("dispatch.fanout_vs_plain", 1.1) is False
    assert report.goal_met("dispatch.jobs_vs_plain", 0.9) is False


@pytest.mark.timeout(240)
def test_bench_quick_prints_every_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEFLEET_")}
    env.update(conftest.test_env(), DEVICEFLEET_STATE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tasks", "bench", "--quick", "--json"],
        cwd=conftest.ROOT, env=env, capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout)
    import torch

    gpu = torch.cuda.is_available()
    assert report.missing_keys(figures, gpu=gpu) == []
    assert set(figures["devices"]) >= {"cpu0", "cpu1"}
    if not gpu:
        assert "gpu" not in figures
