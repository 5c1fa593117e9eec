"""Unit tests of commands' pure logic: their kwargs, the worker's rules, the output and events
readers, and the command line's ``--``; no fleet (tests/test_commands.py runs them on one)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import tasks
from tasks.cli import cli
from tasks.cli.work import run
from tasks.core.commands import CommandParams, CommandPolicy, check_command, resolve_command
from tasks.core.errors import CommandRefused, ConfigError, InvalidJobArguments
from tasks.core.job import JobContext
from tasks.core.worker_config import WorkerConfig
from tasks.jobproc.command_output import MAX_LINE_CHARS, MAX_PARTIAL_BYTES, TAIL_LINES, EventReader, LogSink


def test_placeholders_are_filled_from_the_parameters_and_other_braces_are_left_alone():
    params = CommandParams.model_validate({"argv": ["python", "t.py", "--lr", "{lr}", "--tag={tag}-{{tag}}",
                                                    "--flag", "{on}"], "lr": 0.1, "tag": "a", "on": True})
    assert params.formatted_argv() == ["python", "t.py", "--lr", "0.1", "--tag=a-{tag}", "--flag", "true"]
    assert params.params == {"lr": 0.1, "tag": "a", "on": True}
    # The shell's, JSON's and awk's braces are theirs.
    shell = ["bash", "-c", "echo ${HOME} {unclosed", '{"a": {"b": 1}}', "{print $1}"]
    assert CommandParams(argv=shell).formatted_argv() == shell
    missing = CommandParams.model_validate({"argv": ["python", "--lr", "{lr}"], "seed": 1})
    with pytest.raises(InvalidJobArguments, match=r"\{lr\} names no parameter of the command \(it has seed\)"):
        missing.formatted_argv()
    assert missing.placeholders() == ["lr"]


def test_a_producer_command_is_checked_where_it_is_made():
    assert tasks.command(["python", "t.py"], cwd="runs", env={"A": "1"}).kwargs == {
        "argv": ["python", "t.py"], "cwd": "runs", "env": {"A": "1"}}
    with pytest.raises(ConfigError, match="is a string"):
        tasks.command("python train.py")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="argv"):
        tasks.command([])
    with pytest.raises(ConfigError, match="MASTER_PORT is set by the fleet"):
        tasks.command(["python"], env={"MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="DEVICEFLEET_REDIS_URL is set by the fleet"):
        tasks.command(["python"], env={"DEVICEFLEET_REDIS_URL": "redis://elsewhere"})
    with pytest.raises(ConfigError, match="is not a number, string or bool"):
        tasks.command(["python"], grid=[1, 2])
    for loader in ("LD_PRELOAD", "PYTHONPATH", "BASH_ENV"):
        with pytest.raises(ConfigError, match=f"env {loader} cannot be given: it would make an allowed program load"):
            tasks.command(["python"], env={loader: "/tmp/x"})


def test_a_worker_config_allows_commands_only_with_programs_and_folders():
    assert WorkerConfig.model_validate({"kind": "cpu"}).commands.enabled is False
    with pytest.raises(ValueError, match="commands.workdirs is empty"):
        CommandPolicy(programs=["python"])
    with pytest.raises(ValueError, match="'bin/python' is not a program name or an absolute path"):
        CommandPolicy(programs=["bin/python"], workdirs=["/srv"])
    with pytest.raises(ValueError, match="'runs' is not an absolute path"):
        CommandPolicy(programs=["python"], workdirs=["runs"])


def test_programs_resolve_on_the_workers_path_and_a_symlink_to_an_allowed_one_is_allowed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = bin_dir / "tool"
    real.write_text("#!/bin/sh\necho hi\n")
    real.chmod(0o755)
    (bin_dir / "alias").symlink_to(real)
    other = bin_dir / "other"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    rules = CommandPolicy(programs=["tool", "/nowhere/gone"], workdirs=[str(work)]).rules(path=str(bin_dir))
    assert rules.programs == {"tool": str(real)} and rules.missing == ["/nowhere/gone"]

    argv, cwd = resolve_command(CommandParams(argv=["tool", "x"], cwd="sub"), "cpu0", rules)
    assert argv == [str(real), "x"] and cwd == work / "sub"
    argv, _ = resolve_command(CommandParams(argv=[str(bin_dir / "alias")]), "cpu0", rules)
    assert argv == [str(bin_dir / "alias")]  # run as named: a virtualenv's python finds its packages so
    # "alias" names no allowed program, though it resolves to one: the producer cannot see that.
    for refused in (["other"], [str(other)], ["./tool"], ["perl"], ["alias"]):
        with pytest.raises(CommandRefused, match="commands.programs allows tool"):
            resolve_command(CommandParams(argv=refused), "cpu0", rules)
    for outside in ("..", "/etc", "sub/../../"):
        with pytest.raises(CommandRefused, match="outside the folders cpu0's worker config allows"):
            resolve_command(CommandParams(argv=["tool"], cwd=outside), "cpu0", rules)
    # A bare name runs the allowed file it names, whatever else of that name is on the worker's
    # PATH (a virtualenv's python stays the virtualenv's).
    by_path = CommandPolicy(programs=[str(real)], workdirs=[str(work)]).rules(path="/nonexistent")
    assert resolve_command(CommandParams(argv=["tool"]), "cpu0", by_path)[0] == [str(real)]
    # The producer's check needs no PATH: names and the files they resolved to.
    check_command(CommandParams(argv=["tool"]), "cpu0", rules)
    check_command(CommandParams(argv=[str(real)]), "cpu0", rules)
    for refused in (["alias"], ["other"]):
        with pytest.raises(CommandRefused, match="is not allowed on cpu0"):
            check_command(CommandParams(argv=refused), "cpu0", rules)
    with pytest.raises(CommandRefused, match="outside the folders"):
        check_command(CommandParams(argv=["tool"], cwd="../.."), "cpu0", rules)
    with pytest.raises(InvalidJobArguments, match="names no parameter"):
        check_command(CommandParams(argv=["tool", "{x}"]), "cpu0", rules)
    with pytest.raises(CommandRefused, match="cpu0 runs no commands"):
        check_command(CommandParams(argv=["tool"]), "cpu0", None)


def test_a_missing_workdir_or_program_is_named_with_its_key_and_fix_and_refused_before_sending(tmp_path):
    """Issue 51: the worker's rules say which configured folder or program is not on its host; the
    producer refuses a command they concern with that reason, not the worker's "could not be started"."""
    gone = tmp_path / "srv" / "projects"
    rules = CommandPolicy(programs=["sh", "no-such-program-51"], workdirs=[str(gone), str(tmp_path)]).rules(
        config="/etc/w/cpu.toml")
    assert rules.missing == ["no-such-program-51"] and rules.missing_workdirs == [str(gone)]
    problems = rules.problems("cpu0")
    assert len(problems) == 2 and all("/etc/w/cpu.toml [commands]" in p for p in problems)
    assert "commands.workdirs" in problems[1] and f"mkdir -p {gone}" in problems[1]
    for refused in (lambda: check_command(CommandParams(argv=["sh"]), "cpu0", rules),
                    lambda: resolve_command(CommandParams(argv=["sh"]), "cpu0", rules)):
        with pytest.raises(CommandRefused, match=rf"commands.workdirs folder {gone} does not exist on cpu0") as exc:
            refused()
        assert "PosixPath" not in str(exc.value) and "could not be started" not in str(exc.value)
    # A workdir that exists still runs; a folder below one that does not is refused too.
    check_command(CommandParams(argv=["sh"], cwd=str(tmp_path)), "cpu0", rules)
    with pytest.raises(CommandRefused, match=f"{gone} does not exist"):
        check_command(CommandParams(argv=["sh"], cwd="sub"), "cpu0", rules)
    with pytest.raises(CommandRefused, match="'no-such-program-51' was not found on cpu0's PATH .* /etc/w/cpu.toml"):
        check_command(CommandParams(argv=["no-such-program-51"], cwd=str(tmp_path)), "cpu0", rules)
    # Nothing found at all: still the reason, not "runs no commands".
    none_found = CommandPolicy(programs=["no-such-program-51"], workdirs=[str(tmp_path)]).rules()
    with pytest.raises(CommandRefused, match="was not found on cpu0's PATH"):
        check_command(CommandParams(argv=["no-such-program-51"]), "cpu0", none_found)
    with pytest.raises(CommandRefused, match=r"uncomment \[commands\] in worker_configs/cpu.toml"):
        check_command(CommandParams(argv=["sh"]), "cpu0", None)


def test_a_home_workdir_is_the_workers_home_and_deploy_refuses_it(tmp_path, monkeypatch):
    """'Your own script' allows ~/fleet-scripts (issue 51): a folder a fresh machine can have."""
    from tasks.ops.deploy import command_paths

    monkeypatch.setenv("HOME", str(tmp_path))
    policy = CommandPolicy(programs=["sh"], workdirs=["~/fleet-scripts"])
    assert policy.rules().missing_workdirs == [str(tmp_path / "fleet-scripts")]
    (tmp_path / "fleet-scripts").mkdir()
    rules = policy.rules()
    assert rules.workdirs == [str(tmp_path / "fleet-scripts")] and rules.problems("cpu0") == []
    assert resolve_command(CommandParams(argv=["sh"]), "cpu0", rules)[1] == tmp_path / "fleet-scripts"
    with pytest.raises(ConfigError, match="'~/fleet-scripts': under systemd"):
        command_paths(policy)
    with pytest.raises(ValueError, match="not an absolute path"):
        CommandPolicy(programs=["sh"], workdirs=["fleet-scripts"])


def test_an_os_error_reads_without_a_repr(tmp_path):
    from tasks.jobproc.command import os_error_text
    try:
        (tmp_path / "gone").read_text()
    except OSError as exc:
        assert os_error_text(exc) == f"No such file or directory: {tmp_path / 'gone'}"


def test_the_log_sink_keeps_every_byte_splits_lines_across_reads_and_keeps_the_tail(tmp_path):
    batches: list[list[list[str]]] = []
    sink = LogSink(tmp_path, batches.append)
    sink.write("stdout", b"par")
    sink.write("stdout", b"tial\r\nsecond\n")
    sink.write("stderr", b"\xff bad utf-8\n")
    for i in range(30):
        sink.write("stdout", f"n{i}\n".encode())
    sink.write("stderr", b" 10%|#   |\r 50%|##  |\r100%|####|\n")  # a bar redrawn in place
    sink.write("stdout", b"no newline at the end")
    sink.close()
    lines = [line for batch in batches for line in batch]
    assert lines[:3] == [["out", "partial"], ["out", "second"], ["err", "\ufffd bad utf-8"]]
    assert ["err", "100%|####|"] in lines
    assert lines[-1] == ["out", "no newline at the end"] and len(lines) == 35 == sink.lines
    assert len(sink.tail) == TAIL_LINES and sink.tail[-1] == "no newline at the end"
    assert (tmp_path / "stdout.log").read_bytes().startswith(b"partial\r\nsecond\nn0\n")
    assert (tmp_path / "stderr.log").read_bytes() == b"\xff bad utf-8\n 10%|#   |\r 50%|##  |\r100%|####|\n"
    # A line that never ends is sent in pieces rather than kept whole in memory.
    pieces: list[list[list[str]]] = []
    endless = LogSink(tmp_path / "endless", pieces.append)
    for _ in range(3):
        endless.write("stdout", b"x" * (MAX_PARTIAL_BYTES // 2 + 1))
    endless.close()
    assert [len(line) for batch in pieces for _, line in batch] == [MAX_LINE_CHARS, MAX_LINE_CHARS]


def test_events_feed_progress_scalars_and_output_and_a_bad_one_is_counted_not_fatal(tmp_path):
    reports: list[dict[str, object]] = []
    scalars: list[tuple[int, dict[str, object]]] = []
    ctx = JobContext(device="cpu0", torch_device="cpu", job_id="j", artifacts_dir=tmp_path,
                     reporter=reports.append, scalar_sink=lambda step, values: scalars.append((step, values)))
    reader = EventReader(ctx)
    lines = [{"progress": {"step": 1, "total": 2}}, {"scalars": {"loss": 0.5}, "step": 1},
             {"output": {"loss": 0.5}}, {"output": {"accuracy": 0.9}}]
    data = b"".join(json.dumps(event).encode() + b"\n" for event in lines)
    reader.feed(data[:7])
    reader.feed(data[7:] + b"not json\n" + b'{"scalars": {"loss": 1}}\n' + b'{"hello": 1}\n' + b"[1]\n")
    assert reports == [{"step": 1, "total": 2}] and scalars == [(1, {"loss": 0.5})]
    assert reader.output == {"loss": 0.5, "accuracy": 0.9}
    assert reader.errors == 4  # not JSON, scalars without a step, no known key, not an object


def test_the_command_line_takes_a_program_after_dashes_and_refuses_mixtures():
    runner = CliRunner()
    both = runner.invoke(cli, ["run", "train", "--", "python", "t.py"])
    assert both.exit_code == 2 and "give a JOB ('train') or a command after --, not both" in both.output
    neither = runner.invoke(cli, ["run"])
    assert neither.exit_code == 2 and "give a JOB, or a command after --" in neither.output
    empty = runner.invoke(cli, ["run", "--"])
    assert empty.exit_code == 2 and "nothing after --" in empty.output
    env_for_job = runner.invoke(cli, ["run", "train", "--env", "A=1"])
    assert env_for_job.exit_code == 2 and "--env and --cwd go with a command" in env_for_job.output
    bad_env = runner.invoke(cli, ["run", "--env", "A", "--", "python"])
    assert bad_env.exit_code == 2 and "'A' is not NAME=VALUE" in bad_env.output
    # What follows -- is the program's, even where it looks like devicefleet's own options.
    ctx = run.make_context("run", ["--devices", "cpu0", "--", "python", "t.py", "--devices", "--json"])
    assert ctx.meta["devicefleet.argv"] == ["python", "t.py", "--devices", "--json"]
    assert ctx.params["devices"] == "cpu0" and ctx.params["as_json"] is False and ctx.params["job"] is None
