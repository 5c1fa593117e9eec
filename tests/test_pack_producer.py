"""Packed sweeps, the producer's part (tasks.producer.packing): pure, no fleet."""

from __future__ import annotations

import pytest

from tasks.core.errors import ConfigError
from tasks.core.records import JobOptions, WorkerRecord
from tasks.producer.fanout import JobSpec
from tasks.producer.packing import packed_spec, plan_packing

pytestmark = pytest.mark.timeout(30)


def _record(device: str, packable: dict[str, list[str]]) -> WorkerRecord:
    return WorkerRecord(device=device, kind="cpu", worker=f"w@{device}", host="h", pid=1, queues=[device],
                        cores=[0], pool="solo", jobs=["train", "sleep", "command"], started_at=0.0,
                        packable=packable)


LIVE = {"cpu0": _record("cpu0", {"train": ["hidden"]}), "cpu1": _record("cpu1", {})}


def _specs(name: str, *trials: dict) -> list[JobSpec]:
    return [JobSpec.of(name, trial) for trial in trials]


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "4", "many", [2]])
def test_bad_pack_values_are_refused_with_one_line_naming_them(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        plan_packing(bad, _specs("train", {"lr": 0.1}), ["cpu0"], LIVE)
    message = str(info.value)
    assert f"pack={bad!r}" in message and "\n" not in message and "nothing was sent" in message


def test_job_options_refuse_a_bad_pack_and_carry_a_good_one() -> None:
    assert JobOptions(pack=4).pack == 4 and JobOptions(pack="auto").pack == "auto"
    with pytest.raises(ValueError, match="pack=0"):
        JobOptions(pack=0)


def test_a_job_a_chosen_worker_does_not_list_as_packable_is_refused_naming_the_device() -> None:
    with pytest.raises(ConfigError, match=r"does not pack on cpu1"):
        plan_packing(4, _specs("train", {"lr": 0.1}), ["cpu0", "cpu1"], LIVE)
    with pytest.raises(ConfigError, match=r"job 'sleep' does not pack on cpu0"):
        plan_packing("auto", _specs("sleep", {"seconds": 1}), ["cpu0"], LIVE)


def test_a_command_and_a_device_group_are_refused() -> None:
    command = [JobSpec.of("command", {"argv": ["true"]})]
    with pytest.raises(ConfigError, match="a command cannot be packed"):
        plan_packing(2, command, ["cpu0"], LIVE)
    with pytest.raises(ConfigError, match="group=2"):
        plan_packing(2, _specs("train", {"lr": 0.1}), ["cpu0"], LIVE, group=2)


def test_trials_of_one_shape_pack_and_their_options_carry_it() -> None:
    specs = _specs("train", {"lr": 0.1, "hidden": 64}, {"lr": 0.01, "hidden": 64})
    packing = plan_packing(8, specs, ["cpu0"], LIVE)
    assert (packing.pack, packing.reason) == (8, "packed 8")
    assert [packed_spec(s, packing).options.pack for s in specs] == [8, 8]
    assert plan_packing("auto", specs, ["cpu0"], LIVE).reason == "packed auto"


def test_trials_that_differ_in_a_key_param_run_unpacked_and_say_why() -> None:
    specs = _specs("train", {"hidden": 64}, {"hidden": 128}, {"hidden": 64})
    packing = plan_packing(4, specs, ["cpu0"], LIVE)
    assert packing.pack is None and packing.reason == "unpacked: trials differ in hidden (128, 64)"
    assert packed_spec(specs[0], packing).options.pack is None
    # a trial that leaves the key to the job's default counts as another shape
    mixed = plan_packing(4, _specs("train", {"hidden": 64}, {"lr": 0.1}), ["cpu0"], LIVE)
    assert mixed.reason == "unpacked: trials differ in hidden (64, default)"
    assert plan_packing(None, specs, ["cpu0"], LIVE).reason == "unpacked"


def test_cli_sweep_refuses_a_bad_pack_in_one_line_before_reading_the_fleet() -> None:
    from click.testing import CliRunner

    from tasks.cli import cli

    result = CliRunner().invoke(cli, ["sweep", "train", "--grid", '{"seed": [0, 1]}', "--pack", "0",
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code != 0
    assert "pack=0: give a number of trials" in " ".join(result.output.split())


def test_a_study_packs_on_its_fixed_kwargs_and_runs_unpacked_when_it_samples_a_key_param() -> None:
    from tasks.producer.packing import plan_study_packing

    base = JobSpec.of("train", {"hidden": 64})
    assert plan_study_packing(4, base, ["lr", "seed"], ["cpu0"], LIVE).reason == "packed 4"
    sampled = plan_study_packing("auto", base, ["lr", "hidden"], ["cpu0"], LIVE)
    assert sampled.pack is None
    assert sampled.reason == "unpacked: the study samples hidden, which the models' shapes hang on"
    # the sweep's refusals, the same one line each
    with pytest.raises(ConfigError, match=r"pack=0"):
        plan_study_packing(0, base, ["lr"], ["cpu0"], LIVE)
    with pytest.raises(ConfigError, match=r"job 'train' does not pack on cpu1"):
        plan_study_packing(2, base, ["lr"], ["cpu1"], LIVE)
    with pytest.raises(ConfigError, match="a command cannot be packed"):
        plan_study_packing(2, JobSpec.of("command", {"argv": ["true"]}), ["lr"], ["cpu0"], LIVE)


def test_cli_optimize_refuses_a_bad_pack_in_one_line_before_reading_the_fleet() -> None:
    pytest.importorskip("optuna")
    from click.testing import CliRunner

    from tasks.cli import cli

    result = CliRunner().invoke(cli, ["optimize", "train", "--space", '{"lr": {"low": 0.001, "high": 0.1}}',
                                      "--trials", "2", "--objective", "accuracy", "--pack", "0",
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code != 0
    assert "pack=0: give a number of trials" in " ".join(result.output.split())
