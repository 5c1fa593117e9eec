"""``devicefleet bench --quick``: every figure is there and finite (the figures are not judged)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.bench import commands, isolation, report, slots
from tasks.bench.dispatch import percentile
from tasks.bench.run import run_bench
from tasks.bench.sweep import ideal_makespan, trial_lengths
from tasks.core.devices import Device
from tasks.core.errors import ConfigError
from tasks.core.settings import Settings
from tasks.core.worker_config import load_worker_config
from tasks.jobproc.registry import JobRegistry

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
    # A crash: its entry, and the device's next job, within a second of it.
    assert report.goal_met("isolation.crash_to_entry_s", 0.2) is True
    assert report.goal_met("isolation.next_job_after_crash_s", 1.5) is False
    assert report.goal_met("isolation.cancel_grace_s", 1.0) is None
    # A command through the fleet within 5% of the same program started directly; its lines
    # at the producer within half a second.
    assert report.goal_met("commands.vs_direct", 1.04) is True
    assert report.goal_met("commands.vs_direct", 1.06) is False
    assert report.goal_met("commands.log_latency_s", 0.6) is False


def _packaged_copy(folder: Path) -> tuple[Path, Path]:
    """The packaged worker configs copied into ``folder``: ``(the packaged folder, the copy)``."""
    folder.mkdir()
    packaged = Settings.load().worker_configs_path
    for path in packaged.glob("*.toml"):
        (folder / path.name).write_text(path.read_text())
    return packaged, folder


def test_bench_worker_configs_set_the_cancel_grace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    packaged, source = _packaged_copy(tmp_path / "source")
    (source / "cpu1.toml").write_text('kind = "cpu"\ncancel_grace_s = 30.0\n')  # its own value goes
    configs = isolation.write_worker_configs(source, tmp_path / "bench", 0.5)
    for name in ("cpu0", "cpu1", "gpu0"):
        assert load_worker_config(configs, Device.parse(name)).cancel_grace_s == 0.5
    assert load_worker_config(configs, Device.parse("cpu0")).max_job_seconds == \
        load_worker_config(packaged, Device.parse("cpu0")).max_job_seconds  # the rest is the copy's


def test_bench_worker_configs_allow_the_interpreter_in_the_bench_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    packaged, source = _packaged_copy(tmp_path / "source")
    (source / "cpu1.toml").write_text('kind = "cpu"\n[commands]  # its own goes\nprograms = ["bash"]\n'
                                      'workdirs = ["/srv"]\n')
    configs = isolation.write_worker_configs(source, tmp_path / "bench")
    workdir = tmp_path / "commands"
    commands.write_commands_table(configs, workdir)
    for name in ("cpu0", "cpu1", "gpu0"):
        policy = load_worker_config(configs, Device.parse(name)).commands
        assert (policy.programs, policy.workdirs) == ([sys.executable], [str(workdir)]), name
    assert load_worker_config(configs, Device.parse("cpu0")).cancel_grace_s == isolation.CANCEL_GRACE_S
    # Commands set as dotted keys cannot be replaced: refused, not half-merged.
    (configs / "cpu1.toml").write_text('kind = "cpu"\ncommands.programs = ["bash"]\n')
    with pytest.raises(ConfigError, match="cpu1.toml"):
        commands.write_commands_table(configs, workdir)


def test_bench_slot_configs_set_the_slots_of_every_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, source = _packaged_copy(tmp_path / "source")
    (source / "gpu1.toml").write_text('kind = "gpu"\nconcurrency = 3\n')  # the old name goes too
    configs = slots.write_slot_configs(source, tmp_path / "bench", 4)
    for name in ("cpu0", "gpu0", "gpu1"):
        assert load_worker_config(configs, Device.parse(name)).slots == 4
    # --quick's one fleet: a worker per slot count, each its own file copied from its config.
    configs = slots.write_slot_configs(source, tmp_path / "quick", 1, {"cpu1": 2, "gpu1": 8})
    assert [load_worker_config(configs, Device.parse(name)).slots for name in ("cpu0", "cpu1", "gpu0", "gpu1")] == \
        [1, 2, 1, 8]
    assert load_worker_config(configs, Device.parse("cpu1")).kind.value == "cpu"


def test_misbehaving_jobs_are_only_in_the_bench_allowlist() -> None:
    assert not {"segfault", "hang", "stamp"} & set(JobRegistry(["tasks.jobs"]).names)
    assert {"segfault", "hang", "stamp"} <= set(JobRegistry(["tasks.jobs", isolation.JOB_MODULE]).names)


def test_unknown_bench_section_is_refused_before_anything_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="unknown bench section.*isolaton.*choose from"):
        run_bench(Settings.load(state_dir=tmp_path), sections=["isolaton"])


@pytest.mark.bench
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
    # One round of each misbehaving job; the figures are there, not judged.
    assert figures["isolation"]["rounds"] == 1
    for key in ("crash_to_entry_s", "next_job_after_crash_s", "cancel_to_free_s", "cancel_grace_s"):
        value = figures["isolation"][key]
        assert isinstance(value, (int, float)) and value > 0, (key, value)
    # One round of the command against the program started directly, and every stamped line followed.
    assert figures["commands"]["rounds"] == 1
    assert figures["commands"]["log_lines"] == commands.QUICK_STAMP_LINES
    for key in ("vs_direct", "fleet_s", "direct_s", "log_latency_s", "log_latency_s_p90"):
        value = figures["commands"][key]
        assert isinstance(value, (int, float)) and value > 0, (key, value)
