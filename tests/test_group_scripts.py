"""Your own scripts on a device group (issue 40, item 6): ``devicefleet run --group 2 --devices cpu
-- torchrun --standalone --nproc_per_node=2 torchrun_gloo.py``, and a script that calls
``mp.spawn`` over the cores it sees, run unchanged on the session fleet's ``cpu0+cpu1`` as a user
runs them, with the gloo backend. The fleet's ``[commands]`` allow this Python and its torchrun
in tests/scripts (tests/conftest.py, ``FLEET_COMMANDS``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tasks
from tasks.cli import cli

pytestmark = pytest.mark.timeout(150)


def command_logs(stdout: str) -> str:
    """The whole ``stderr.log`` of each command run the group's entry names: a failure's entry
    keeps only the last lines, after torchrun's summary, which can cut the cause off (issue 51)."""
    try:
        entry = json.dumps(json.loads(stdout)["cpu0+cpu1"])
    except (ValueError, KeyError):
        return "(no entry)"
    logs = [Path(folder) / "stderr.log" for folder in sorted(set(re.findall(r'"log": "([^"]+)"', entry)))]
    return "\n".join(f"--- {log}:\n{log.read_text(errors='replace')[-20000:]}" for log in logs if log.exists()) or "(no log)"


def failure(stdout: str, stderr: str) -> str:
    """What a failed run printed and its commands' own logs, as one message."""
    return f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}\ncommand logs:\n{command_logs(stdout)}"


@pytest.mark.parametrize(("argv", "world"), [
    # No --nprocs: one process per core of its affinity, the group's devices' cores (one each on
    # a 2-core host: a world of 2).
    ([sys.executable, "spawn_gloo.py"], "cores"),
    (["torchrun", "--standalone", "--nproc_per_node=2", "torchrun_gloo.py"], 2),
], ids=["mp_spawn", "torchrun"])
def test_a_launcher_script_runs_unchanged_on_a_group_over_both_devices(argv: list[str], world: int | str,
                                                                      fleet, app) -> None:  # type: ignore[no-untyped-def]
    live = tasks.live_devices(app)
    cores = sorted({*live["cpu0"].cores, *live["cpu1"].cores})
    world_size = len(cores) if world == "cores" else world
    # PYTHONFAULTHANDLER: a rank that aborts (issue 51) dumps every thread's Python stack into the log.
    result = CliRunner().invoke(cli, ["run", "--devices", "cpu", "--group", "2", "--json", "--timeout", "140",
                                      "--env", "PYTHONFAULTHANDLER=1", "--redis-url", fleet.redis_url, "--", *argv])
    # A str message: pytest prints it whole (a tuple's repr is cut at 240 characters, which hid the
    # cause of issue 51's abort).
    assert result.exit_code == 0, failure(result.stdout, result.stderr)
    entry = json.loads(result.stdout)["cpu0+cpu1"]
    assert entry["status"] == "ok" and entry["device"] == "cpu0+cpu1", failure(result.stdout, result.stderr)
    assert entry["output"]["command"]["exit_code"] == 0
    # The script's own line, printed by rank 0 as it came, after the group's name (on stderr with --json).
    lines = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if line.startswith("[cpu0+cpu1] {")]
    assert len(lines) == 1, result.stderr  # rank 0 alone reports
    report = json.loads(lines[0])
    assert report == {**report, "world_size": world_size, "backend": "gloo",
                      "rank_sum": float(sum(range(world_size))), "weights_equal": True,
                      "affinity": cores,
                      # Issue 51: destroy_process_group ended the group's gloo threads (the script
                      # imports torch.distributed.nn first); none is left for the interpreter's exit.
                      "gloo_threads_left": []}
