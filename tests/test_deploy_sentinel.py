"""``devicefleet deploy`` for a Redis Sentinel layout: the three hosts' files, the CLI's errors,
and the rendered configs run as real ``redis-server`` processes and sentinels.

Three hosts on one machine: 127.0.0.1, 127.0.0.2 and 127.0.0.3 (all of 127.0.0.0/8 is loopback on
Linux), so every address, bind and announce line stays as rendered; only what would clash on
one machine (the data folder, log and pid files) is moved: on the command line for Redis, in the
copy a sentinel runs (and rewrites) for the sentinels, whose rendered config names Debian's
folders. Ports are free ones, passed to the plan as a host would pass its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks.cli import cli
from tasks.core.errors import ConfigError
from tasks.core.registry import connect
from tasks.core.sentinel import SentinelURL
from tasks.ops.deploy import HostPlan, commands, join_commands, read_env_value, redis_conf_lines, render
from tasks.ops.proc import free_port
from tasks.ops.redis_server import find_redis_server

from . import system_tools
from .conftest import wait_for
from .test_deploy import _plan

pytestmark = pytest.mark.timeout(60)

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def _layout(tmp: Path, **ports: int) -> list[HostPlan]:
    """The three hosts as an operator renders them: --sentinel on the first, then the printed
    --join ... --this-host command on each other one."""
    first = _plan(tmp / "h1", sentinel_hosts=list(HOSTS), **ports)
    render(first)
    url = first.redis_url
    others = [_plan(tmp / f"h{i}", join_url=url, this_host=host, redis_port=first.redis_port)
              for i, host in enumerate(HOSTS[1:], start=2)]
    for plan in others:
        render(plan)
    return [first, *others]


def _conf(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


# Where the rendered sentinel config puts its files: Debian's folders, which Debian's
# redis-server package creates. A test host may have none of them, and redis-server opens the log
# file and enters the folder while it reads the config file, before any command-line option.
SENTINEL_PLACES = {"pidfile": "/run/sentinel/redis-sentinel.pid", "logfile": "/var/log/redis/redis-sentinel.log",
                   "dir": "/var/lib/redis"}


def _sentinel_conf_in(rendered: Path, run: Path) -> Path:
    """A copy of a rendered sentinel config with its pid file, log file and folder in ``run``,
    every other line as rendered; the rendered config must name Debian's places for them."""
    moved = {"pidfile": run / "sentinel.pid", "logfile": run / "sentinel.log", "dir": run}
    lines = rendered.read_text().splitlines()
    assert {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines
            if line.split(" ", 1)[0] in moved} == SENTINEL_PLACES
    copy = run / "sentinel.conf"
    copy.write_text("".join(f"{key} {moved[key]}\n" if (key := line.split(" ", 1)[0]) in moved else f"{line}\n"
                            for line in lines))
    return copy


def _running(processes: list[subprocess.Popen[bytes]], logs: list[Path]) -> bool:
    """True while every process runs; an exited one fails the test with its log's last lines."""
    for process, log in zip(processes, logs, strict=True):
        if process.poll() is not None:
            tail = log.read_text().splitlines()[-5:] if log.exists() else ["(no log)"]
            raise AssertionError(f"{log.parent.name}'s process exited with {process.returncode}: " + " | ".join(tail))
    return True


# -- rendering -------------------------------------------------------------------------------------


def test_three_hosts_render_a_primary_two_replicas_and_their_sentinels(tmp_path: Path) -> None:
    first, second, third = _layout(tmp_path)
    url = SentinelURL.parse(first.redis_url)
    assert [host for host, _ in url.sentinels] == list(HOSTS) and url.master_name == "devicefleet"
    assert url.password and url.sentinel_password and url.password != url.sentinel_password
    for plan in (first, second, third):
        env = (plan.config_dir / "devicefleet.env").read_text()
        assert read_env_value(env, "DEVICEFLEET_REDIS_URL") == first.redis_url
        assert read_env_value(env, "DEVICEFLEET_DEVICE_NAMES") == "host"
        me = plan.this_host
        redis_conf = _conf(plan.redis_conf_dir / "devicefleet.conf")
        assert {f"bind {me}", f"replica-announce-ip {me}", f"requirepass {url.password}",
                f"masterauth {url.password}", "appendonly yes", "min-replicas-to-write 1"} <= set(redis_conf)
        # Whom to replicate goes into redis.conf itself (Sentinel rewrites it there), never here.
        assert not any(line.startswith("replicaof") for line in redis_conf)
        sentinel_conf = _conf(plan.redis_conf_dir / "sentinel-devicefleet.conf")
        assert {f"bind {me}", f"sentinel announce-ip {me}", f"requirepass {url.sentinel_password}",
                f"sentinel sentinel-pass {url.sentinel_password}",
                "sentinel monitor devicefleet 127.0.0.1 6379 2", f"sentinel auth-pass devicefleet {url.password}",
                "sentinel down-after-milliseconds devicefleet 5000"} <= set(sentinel_conf)
        for path in ("devicefleet.conf", "sentinel-devicefleet.conf"):
            assert (plan.redis_conf_dir / path).stat().st_mode & 0o777 == 0o640
        for unit in ("redis-server.service", "redis-sentinel.service"):
            dropin = (plan.unit_dir / f"{unit}.d" / "devicefleet.conf").read_text()
            assert "After=network-online.target" in dropin
        worker = (plan.unit_dir / "devicefleet-worker@.service").read_text()
        assert "After=network-online.target redis-server.service redis-sentinel.service" in worker
        target = (plan.unit_dir / "devicefleet.target").read_text()
        assert "Wants=redis-server.service redis-sentinel.service devicefleet-worker@cpu0.service" in target
    assert redis_conf_lines(first) == [f"include {first.redis_conf_dir / 'devicefleet.conf'}"]
    assert redis_conf_lines(third)[1:] == ["replicaof 127.0.0.1 6379"]
    assert join_commands(first) == {
        host: f"devicefleet deploy --join '{first.redis_url}' --this-host {host}" for host in HOSTS[1:]}
    assert join_commands(second) == {}
    # The printed commands write the lines Redis and Sentinel rewrite once, on the first install.
    once = [line for line in commands(third) if line.startswith("grep -q '^sentinel monitor devicefleet '")]
    assert len(once) == 1 and "echo 'replicaof 127.0.0.1 6379' >> " in once[0]
    assert "replicaof" not in " ".join(commands(first))
    # The first host's workers start once a replica is there; the others' at once.
    assert "systemctl enable --now devicefleet.target" not in commands(first)
    assert "systemctl enable --now devicefleet.target" in commands(second)


def test_a_host_that_joins_the_sentinels_without_this_host_runs_workers_only(tmp_path: Path) -> None:
    first = _plan(tmp_path / "h1", sentinel_hosts=list(HOSTS))
    plan = _plan(tmp_path / "h4", join_url=first.redis_url)
    render(plan)
    assert not plan.runs_redis and not plan.redis_conf_dir.exists()
    assert "redis" not in (plan.unit_dir / "devicefleet.target").read_text()
    assert read_env_value((plan.config_dir / "devicefleet.env").read_text(), "DEVICEFLEET_REDIS_URL") == first.redis_url


def test_rendering_again_keeps_both_passwords(tmp_path: Path) -> None:
    root = tmp_path / "review"
    runner = CliRunner()
    args = ["deploy", "--root", str(root), "--gpus", "0", "--sentinel", ",".join(HOSTS)]
    first = runner.invoke(cli, args)
    assert first.exit_code == 0, first.output
    env = root / "etc/devicefleet/devicefleet.env"
    url = read_env_value(env.read_text(), "DEVICEFLEET_REDIS_URL")
    assert url is not None and f"--join '{url}' --this-host 127.0.0.3" in first.output
    again = runner.invoke(cli, args)
    assert again.exit_code == 0, again.output
    assert read_env_value(env.read_text(), "DEVICEFLEET_REDIS_URL") == url


@pytest.mark.parametrize(("options", "named"), [
    ({"sentinel_hosts": ["10.0.0.1", "10.0.0.2"]}, "2 hosts"),
    ({"sentinel_hosts": ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]}, "4 hosts"),
    ({"sentinel_hosts": ["10.0.0.1", "10.0.0.2", "10.0.0.1"]}, "10.0.0.1 named twice"),
    ({"sentinel_hosts": ["10.0.0.1", "gpu-b", "10.0.0.3"]}, "'gpu-b' is not an IP address"),
    ({"sentinel_hosts": list(HOSTS), "serve_address": "10.0.0.1"}, "--sentinel excludes --join and --serve"),
    ({"sentinel_hosts": list(HOSTS), "this_host": "127.0.0.2"}, "--this-host '127.0.0.2'"),
    ({"join_url": "sentinel://:pw@10.0.0.1,10.0.0.2,10.0.0.3/0?master_name=devicefleet&sentinel_password=s",
      "this_host": "10.0.0.9"}, "--this-host '10.0.0.9' is not among"),
    ({"join_url": "sentinel://127.0.0.1,127.0.0.2,127.0.0.3/0?master_name=devicefleet", "this_host": "127.0.0.2"},
     "must carry the Redis password and sentinel_password="),
    ({"join_url": "rediss://:pw@10.0.0.1:6380/0", "this_host": "10.0.0.1"}, "--this-host '10.0.0.1' needs"),
])
def test_a_bad_layout_is_refused_naming_the_value(tmp_path: Path, options: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")) as caught:
        _plan(tmp_path, **options)
    assert "pw" not in str(caught.value).replace("password", "")  # no password in the message


def test_the_cli_refuses_a_bad_layout_before_writing_anything(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["deploy", "--root", str(tmp_path), "--gpus", "0",
                                      "--sentinel", "10.0.0.1,10.0.0.2,10.0.0.2"])
    assert result.exit_code == 2 and "10.0.0.2 named twice" in result.output
    assert not (tmp_path / "etc").exists()


@pytest.mark.tools
def test_the_dropins_verify_with_debians_units(tmp_path: Path) -> None:
    """The drop-ins for Debian's redis-server and redis-sentinel units load cleanly onto them
    (each unit that is installed here; verify reads a drop-in folder beside the unit it checks)."""
    analyze = system_tools.tool("systemd-analyze", "systemd")
    installed = [unit for unit in ("redis-server.service", "redis-sentinel.service")
                 if (Path("/lib/systemd/system") / unit).is_file()]
    if not installed:
        system_tools.missing("Debian's redis-server unit", "redis-server")
    plan = _plan(tmp_path, sentinel_hosts=list(HOSTS))
    render(plan)
    for unit in installed:
        shutil.copy(Path("/lib/systemd/system") / unit, plan.unit_dir / unit)
        result = subprocess.run([analyze, "verify", "--man=no", str(plan.unit_dir / unit)],
                                capture_output=True, text=True, timeout=60, cwd=plan.unit_dir)
        output = (result.stdout + result.stderr).strip()
        assert result.returncode == 0 and output == "", f"{unit}: {output}"


# -- the rendered files, run -----------------------------------------------------------------------


#: Debian's redis-server, the one the layout is for.
DEBIAN_REDIS = "/usr/bin/redis-server"


def _redis_binaries() -> list[object]:
    """The Redis the tests run everywhere, and Debian's (a system tool: skipped where it is
    missing, required on CI) unless they are the same program."""
    wheel = str(find_redis_server())
    found: list[object] = [pytest.param(wheel, id="wheel")]
    if not (os.path.exists(DEBIAN_REDIS) and os.path.samefile(wheel, DEBIAN_REDIS)):
        found.append(pytest.param(DEBIAN_REDIS, marks=pytest.mark.tools, id="debian"))
    return found


@contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
        for process in started:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _sentinel_view(host: str, port: int, password: str) -> dict[str, object] | None:
    """What one sentinel says: the primary's address, and the replicas and sentinels it knows."""
    try:
        with redis.Redis(host=host, port=port, password=password, decode_responses=True,
                         socket_connect_timeout=1, socket_timeout=2) as client:
            primary = client.execute_command("SENTINEL", "get-master-addr-by-name", "devicefleet")
            replicas = client.execute_command("SENTINEL", "replicas", "devicefleet")
            sentinels = client.execute_command("SENTINEL", "sentinels", "devicefleet")
    except redis.RedisError:
        return None

    def ips(entries: list[object]) -> set[str]:
        out = set()
        for entry in entries:
            fields = dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
            assert isinstance(fields, dict)
            out.add(str(fields["ip"]))
        return out

    return {"primary": primary[0] if primary else None, "replicas": ips(replicas), "sentinels": ips(sentinels)}


def _writes(client: redis.Redis) -> bool:
    try:
        client.set("deploy-sentinel-test", "ok")
        return client.get("deploy-sentinel-test") == "ok"
    except redis.RedisError:
        return False  # NOREPLICAS until a replica is in sync (min-replicas-to-write 1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("binary", _redis_binaries())
def test_the_rendered_layout_runs_and_fails_over(tmp_path: Path, binary: str) -> None:
    """The three hosts' rendered Redis snippets (included from a redis.conf holding what the
    printed commands add) and sentinel configs, run: the sentinels agree on 127.0.0.1 with two
    replicas and three sentinels, each at its own address; a client of the rendered URL writes.
    Then the primary is killed: a replica is promoted, the URL writes there, and Sentinel's
    CONFIG REWRITE has moved the replicaof lines in the redis.conf files, not in the snippets."""
    if not os.path.exists(binary):
        system_tools.missing(binary, "redis-server")
    plans = _layout(tmp_path / "render", redis_port=free_port(), sentinel_port=free_port())
    url = plans[0].redis_url
    parsed = SentinelURL.parse(url)
    assert parsed.password is not None and parsed.sentinel_password is not None
    redis_port, sentinel_port = plans[0].redis_port, plans[0].sentinel_port
    with _processes() as started:
        for plan in plans:  # Redis first, so each sentinel's first INFO lists both replicas
            run = tmp_path / "run" / str(plan.this_host)
            run.mkdir(parents=True)
            (run / "redis.conf").write_text("\n".join(redis_conf_lines(plan)) + "\n")
            started.append(subprocess.Popen(
                [binary, str(run / "redis.conf"), "--dir", str(run), "--logfile", str(run / "redis.log"),
                 # Not the rendered layout's concern, only this test's time: a primary waits this
                 # long (5 s by default on Redis 7, diskless sync) for more replicas before a full sync.
                 "--repl-diskless-sync-delay", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        primary = redis.Redis(host=HOSTS[0], port=redis_port, password=parsed.password, decode_responses=True,
                              socket_connect_timeout=1, socket_timeout=2)

        def online_replicas() -> int:
            try:
                info = primary.info("replication")
            except redis.RedisError:
                return 0
            return sum(1 for key, value in info.items()
                       if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")

        wait_for(lambda: online_replicas() == 2, 20, "both replicas in sync")
        primary.close()
        for plan in plans:
            run = tmp_path / "run" / str(plan.this_host)
            conf = _sentinel_conf_in(plan.redis_conf_dir / "sentinel-devicefleet.conf", run)
            started.append(subprocess.Popen([binary, str(conf), "--sentinel"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def agree(on: str, live: tuple[str, ...]) -> bool:
            """Every live sentinel names ``on`` as the primary, the two other hosts as its replicas
            and the two other sentinels, each by its own address (a dead one stays listed, to be
            reconfigured when it comes back)."""
            views = {host: _sentinel_view(host, sentinel_port, parsed.sentinel_password or "") for host in live}
            return all(view == {"primary": on, "replicas": set(HOSTS) - {on}, "sentinels": set(HOSTS) - {host}}
                       for host, view in views.items())

        sentinel_logs = [tmp_path / "run" / str(plan.this_host) / "sentinel.log" for plan in plans]
        wait_for(lambda: _running(started[3:], sentinel_logs) and agree(HOSTS[0], HOSTS), 20, "the sentinels to agree on 127.0.0.1, 2 replicas, 3 sentinels")
        with connect(url) as client:
            wait_for(lambda: _writes(client), 10, "a write through the rendered URL")
            client.set("before-failover", "kept")
            assert client.execute_command("WAIT", 2, 5000) == 2
        for port in (redis_port, sentinel_port):  # no password, no entry
            with pytest.raises(redis.AuthenticationError), \
                    redis.Redis(host=HOSTS[1], port=port, retry=Retry(NoBackoff(), 0)) as anonymous:
                anonymous.ping()

        # The host of the primary dies (its Redis and its sentinel).
        started[0].kill()
        started[3].kill()
        for process in (started[0], started[3]):
            process.wait(10)
        survivors = HOSTS[1:]

        def promoted() -> str | None:
            view = _sentinel_view(survivors[0], sentinel_port, parsed.sentinel_password or "")
            return str(view["primary"]) if view and view["primary"] in survivors else None

        new = wait_for(promoted, 30, "a replica promoted")
        wait_for(lambda: agree(new, survivors), 15, f"the two live sentinels to agree on {new}")
        # A new client, as a worker started now: the first sentinel in the URL is the dead one.
        with connect(url) as client:
            wait_for(lambda: _writes(client), 20, "a write through the rendered URL after the failover")
            assert client.execute_command("ROLE")[0] == "master"
            assert client.get("before-failover") == "kept"
            assert client.connection_pool.get_master_address() == (new, redis_port)  # type: ignore[attr-defined]

        other = next(host for host in survivors if host != new)
        run = tmp_path / "run"
        wait_for(lambda: f"replicaof {new} {redis_port}" in (run / other / "redis.conf").read_text(), 15,
                 f"{other}'s redis.conf to follow {new}")
        assert "replicaof" not in (run / new / "redis.conf").read_text()
        for plan in plans:  # the snippets are as rendered: Sentinel wrote to redis.conf only
            assert not any(line.startswith("replicaof") for line in _conf(plan.redis_conf_dir / "devicefleet.conf"))
