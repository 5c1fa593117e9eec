"""Every refusal the command line makes before anything is sent (issue 51), against the session
fleet: each exits 2 (``EXIT_CONFIG``, click's usage errors included) with one ``Error:`` line
that names the bad value; a job that failed exits 1, and a fleet that is not there exits 3.
In-process (click's runner), so each case costs a Redis read or two, not a process."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tasks.cli import cli
from tasks.core.errors import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_FLEET_LOST,
    CommandRefused,
    ConfigError,
    DeviceUnavailable,
    FleetLost,
    InvalidJobArguments,
    NoFleetError,
    exit_status,
)

from .conftest import producer_connections, wait_for

pytestmark = pytest.mark.timeout(60)

#: (case, argv after the command's name, the bad value its message must name).
REFUSALS = [
    ("unknown job", ["run", "no_such_job"], "no_such_job"),
    ("unknown device", ["run", "echo", "--devices", "gpu0"], "gpu0"),
    ("unknown device name", ["run", "echo", "--devices", "tpu0"], "tpu0"),
    ("group cannot form", ["run", "echo", "--devices", "cpu", "--group", "3"], "group of 3"),
    ("bad kwargs JSON", ["run", "echo", "--kwargs", "{not json"], "{not json"),
    ("kwargs not an object", ["run", "echo", "--kwargs", "[1]"], "[1]"),
    ("bad kwargs name", ["run", "counted", "--devices", "cpu0", "--kwargs", '{"scoore": 1}'], "scoore"),
    ("bad kwargs value", ["run", "counted", "--devices", "cpu0", "--kwargs", '{"seconds": "soon"}'], "soon"),
    ("bad priority", ["run", "echo", "--priority", "urgnt"], "urgnt"),
    ("bad time limit", ["run", "echo", "--time-limit", "-1"], "-1"),
    ("job and command", ["run", "echo", "--", "bash", "x.sh"], "echo"),
    ("program not allowed", ["run", "--devices", "cpu0", "--", "perl", "-e", "1"], "perl"),
    ("workdir outside", ["run", "--devices", "cpu0", "--cwd", "/etc", "--", "bash", "x.sh"], "/etc"),
    ("env not NAME=VALUE", ["run", "--env", "NOVALUE", "--", "bash", "x.sh"], "NOVALUE"),
    ("env the fleet sets", ["run", "--env", "LD_PRELOAD=x.so", "--", "bash", "x.sh"], "LD_PRELOAD"),
    ("placeholder with no parameter", ["run", "--devices", "cpu0", "--", "bash", "{nothing}"], "nothing"),
    ("grid axis not a list", ["sweep", "counted", "--grid", '{"score": 1}'], "score"),
    ("grid not JSON", ["sweep", "counted", "--grid", "{score"], "{score"),
    ("pack of 0", ["sweep", "counted", "--grid", '{"score": [1]}', "--pack", "0"], "pack=0"),
    ("sweep job unknown", ["sweep", "no_such_job", "--grid", '{"score": [1]}'], "no_such_job"),
]


@pytest.mark.parametrize(("argv", "named"), [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_every_refusal_before_sending_exits_2_with_one_line_naming_the_bad_value(argv, named, fleet) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(cli, [*argv, "--redis-url", fleet.redis_url] if "--" not in argv else
                                [*argv[:argv.index("--")], "--redis-url", fleet.redis_url, *argv[argv.index("--"):]])
    assert result.exit_code == EXIT_CONFIG, (result.exit_code, result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and named in errors[0], result.output
    assert "devicefleet up" not in errors[0], result.output  # the fleet runs: `up` cannot help


def test_a_failed_job_exits_1_and_no_fleet_exits_3(fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    before = producer_connections(fleet.redis_url)
    failed = CliRunner().invoke(cli, ["run", "fail", "--devices", "cpu0", "--json", "--redis-url", fleet.redis_url])
    # The command's producer app closed its connections as the command ended (in process too;
    # Redis lists a closed connection until it has read the close, hence a wait).
    wait_for(lambda: producer_connections(fleet.redis_url) == before, 10, "the CLI's producer connections to close")
    assert failed.exit_code == EXIT_FAILED and json.loads(failed.stdout)["cpu0"]["status"] == "error"
    gone = CliRunner().invoke(cli, ["run", "echo"], env={"DEVICEFLEET_STATE_DIR": str(tmp_path),
                                                         "DEVICEFLEET_REDIS_URL": None})
    assert gone.exit_code == EXIT_FLEET_LOST, gone.output


def test_one_exit_rule_for_python_and_the_command_line() -> None:
    """The same errors a Python producer gets are the CLI's exit statuses."""
    for refusal in (ConfigError("x"), InvalidJobArguments("x"), CommandRefused("x"), DeviceUnavailable(["gpu0"], [])):
        assert exit_status(refusal) == EXIT_CONFIG
    assert exit_status(FleetLost("x")) == exit_status(NoFleetError("x")) == EXIT_FLEET_LOST
    assert exit_status(RuntimeError("x")) == EXIT_FAILED
    assert "devicefleet up" in str(DeviceUnavailable(["gpu0"], []))
    running = str(DeviceUnavailable(["gpu0"], ["cpu0", "cpu1"]))
    assert "devicefleet worker" in running and "--devices cpu0,cpu1" in running and "devicefleet up" not in running


def test_after_an_interrupt_no_command_reads_the_reply_of_the_one_it_cut(fleet) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C raises where the wait is: between a Redis command and its reply, redis-py hands the
    connection back to its pool with the reply unread, and the next command read it as its own
    (a sweep's cancel after Ctrl-C failed with ``int()`` of an ``MGET``'s list). The CLI drops the
    connections the wait used before it cancels (``drop_connections``, ``Connections.drop``):
    here a ``BLPOP`` whose reply comes a second later stands for the cut command."""
    from tasks.producer.connections import Connections

    app = fleet.app()
    try:
        connections = Connections.of(app)
        for client, drop in ((app.backend.client, app.drop_connections), (connections.redis, connections.drop)):
            cut = client.connection_pool.get_connection()
            cut.send_command("BLPOP", "devicefleet-test:never", 1)  # interrupted before its reply
            client.connection_pool.release(cut)
            drop()
            assert client.set("devicefleet-test:after-interrupt", "1") is True  # its own reply, not BLPOP's
    finally:
        app.close()
