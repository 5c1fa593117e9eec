"""The units ``devicefleet deploy`` renders, under a real systemd (``-k under_systemd``).

One container (tests/systemd_container.py) boots for the module: systemd as its PID 1, the
rendered units, configs, sysusers.d and tmpfiles.d files bound in, and Debian's redis-server
run by Debian's own unit with the rendered snippet. Producers send from this process, outside
the container, through the rendered Redis URL. The tests add to the rendered environment file
only what a user adds for their own jobs (the test job modules and short lease timings).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks import fan_out, live_devices
from tasks.core.accounts import CAPABILITY_NUMBERS, held_capabilities
from tasks.core.app import create_app
from tasks.core.registry import connect
from tasks.core.settings import Settings
from tasks.ops.deploy import HostPlan, plan_host, render
from tasks.ops.proc import free_port
from tasks.ops.usage import read_fleet_usage
from tasks.ops.users import add_user, remove_user

from . import system_tools
from .conftest import ROOT, http_status, read_markers, wait_for
from .systemd_container import BootFailed, Container, nspawn_binary
from .systemd_units import exposure_level

# A real system rig (systemd-nspawn, root): its own step in .ci/run, `python3 -m pytest -m system`.
pytestmark = [pytest.mark.system, pytest.mark.timeout(120)]

WORKERS = ["devicefleet-worker@cpu0.service", "devicefleet-worker@cpu1.service"]
SERVICES = ["redis-server.service", *WORKERS, "devicefleet-flower.service", "devicefleet-metrics.service"]
STATE = Path("/var/lib/devicefleet")


class Host:
    """The container and what the tests need to reach it."""

    def __init__(self, box: Container, plan: HostPlan, units: Path, state: Path) -> None:
        self.box, self.plan, self.units, self.state = box, plan, units, state
        self.etc = units.parent.parent
        self.app = create_app(Settings.load(redis_url=plan.redis_url, state_dir=state / "producer",
                                            job_modules=["tasks.jobs", "tests.fleet_jobs", "tests.reliability_jobs"]))

    def marker_dir(self, name: str) -> tuple[Path, str]:
        """A folder the workers may write (under the state dir): its host path and its path inside."""
        host = self.state / "markers" / name
        host.mkdir(parents=True)
        os.chmod(host, 0o777)
        return host, str(STATE / "markers" / name)

    def active(self, unit: str) -> bool:
        return self.box.systemctl("is-active", unit, check=False).strip() == "active"

    def main_pid(self, unit: str) -> int:
        return int(self.box.show(unit, "MainPID")["MainPID"])

    def workers_ready(self) -> bool:
        """Every unit active, and each worker in the fleet registry as its unit's main process."""
        if not all(self.active(u) for u in SERVICES):
            return False
        live = {d: r.pid for d, r in live_devices(self.app).items()}
        return live == {u.split("@")[1].removesuffix(".service"): self.main_pid(u) for u in WORKERS}

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(self.workers_ready, timeout, "every unit active and both workers in the registry")

    def dropin(self, unit: str, name: str, text: str | None) -> None:
        """Write (or with None remove) a drop-in from the host side, then daemon-reload."""
        path = self.units / f"{unit}.d" / name
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        self.box.systemctl("daemon-reload")


def _require_nspawn() -> str:
    found = nspawn_binary()
    if found is None:
        system_tools.missing("systemd-nspawn", "systemd-container")
    if os.geteuid() != 0:
        pytest.skip("booting a systemd container needs root")
    assert found is not None
    system_tools.tool("/usr/bin/redis-server", "redis-server")
    return found


def _render(tmp: Path) -> tuple[HostPlan, Path]:
    root = tmp / "root"
    plan = plan_host(gpus=0, cpu_workers=2, root=root, worker_configs_src=ROOT / "worker_configs",
                     devicefleet_bin=Path(sys.executable).parent / "devicefleet", redis_port=free_port(),
                     flower_port=free_port(), metrics_port=free_port())
    render(plan, root)
    etc = root / "etc"
    # What the user adds for their own jobs, and short leases so a killed job comes back fast.
    with open(etc / "devicefleet" / "devicefleet.env", "a") as env:
        env.write(f'DEVICEFLEET_JOB_MODULES="tasks.jobs,tests.fleet_jobs,tests.reliability_jobs"\n'
                  f'PYTHONPATH="{ROOT}"\nDEVICEFLEET_LEASE_TTL_S="3"\nDEVICEFLEET_REAPER_INTERVAL_S="0.5"\n'
                  f'DEVICEFLEET_HEARTBEAT_INTERVAL_S="0.5"\nDEVICEFLEET_HEARTBEAT_TTL_S="2"\n')
    # What Debian's redis-server package provides on a real host: its user and its main config,
    # which `devicefleet deploy`'s commands extend with the rendered snippet.
    (etc / "sysusers.d" / "redis.conf").write_text("u redis - - /var/lib/redis\n")
    (etc / "tmpfiles.d" / "redis.conf").write_text("d /var/lib/redis 0750 redis redis -\n")
    (etc / "redis" / "redis.conf").write_text("include /etc/redis/devicefleet.conf\ndir /var/lib/redis\n")
    for conf in (etc / "redis").iterdir():
        conf.chmod(0o644)  # the container's redis user is not the host's
    return plan, root


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    nspawn = _require_nspawn()
    tmp = tmp_path_factory.mktemp("systemd")
    plan, root = _render(tmp)
    etc = root / "etc"
    state = tmp / "state"
    state.mkdir()
    box = Container(nspawn, f"dftest{os.getpid()}", tmp / "console.log")
    for sub in ("systemd/system", "devicefleet", "redis", "sysusers.d", "tmpfiles.d"):
        box.binds.append((etc / sub, Path("/etc") / sub, True))
    # The environment and checkout the units run code from, at the same paths.
    for code in sorted({*plan.code_dirs, ROOT}):
        if not code.is_relative_to("/usr"):
            box.binds.append((code, code, True))
    box.binds.append((state, STATE, False))
    try:
        box.boot()
    except BootFailed as exc:
        box.stop()
        pytest.skip(f"systemd-nspawn could not boot a container here: {exc}")
    try:
        yield Host(box, plan, etc / "systemd" / "system", state)
    finally:
        box.stop()


@pytest.fixture(scope="module")
def fleet_host(host: Host) -> Host:
    host.box.systemctl("start", "devicefleet.target")
    host.wait_ready(90)
    return host


def _markers(path: Path) -> list[str]:
    return [marker["event"] for marker in read_markers(path)]


# -- 1. the target brings everything up ----------------------------------------------------------


def test_target_starts_redis_workers_flower_and_exporter_under_systemd(fleet_host: Host) -> None:
    box = fleet_host.box
    wants = box.show("devicefleet.target", "Wants")["Wants"].split()
    assert set(SERVICES) <= set(wants)
    results = fan_out("probe", "all", app=fleet_host.app).get(timeout=60)
    assert {d: e["status"] for d, e in results.items()} == {"cpu0": "ok", "cpu1": "ok"}
    for device, entry in results.items():
        unit = f"devicefleet-worker@{device}.service"
        pid = fleet_host.main_pid(unit)
        # The job ran in a job process of the unit's own main process, as the unit's user.
        assert entry["output"]["worker_pid"] == pid
        for process in (pid, entry["output"]["pid"]):
            assert box.run("ps", "-o", "user=", "-p", str(process)).stdout.strip() == "devicefleet"
        assert entry["visibility"]["cuda_visible_devices"] == "-1"
        status = box.run("cat", f"/proc/{pid}/status").stdout
        assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status  # the filter is on
    # Flower behind its login; the exporter's metrics.
    flower = f"http://127.0.0.1:{fleet_host.plan.flower_port}/"
    wait_for(lambda: http_status(flower) == 401, 30, "Flower to answer (401 without its login)")
    assert http_status(flower + "workers", fleet_host.plan.flower_auth) == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet_host.plan.metrics_port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and "devicefleet_" in reply.read().decode()


# -- 2. kill -9 mid-job ----------------------------------------------------------------------------


def test_kill_9_of_a_worker_under_systemd_restarts_it_and_the_job_runs_again(fleet_host: Host) -> None:
    unit = WORKERS[0]
    restarts = int(fleet_host.box.show(unit, "NRestarts")["NRestarts"])
    host_dir, inside = fleet_host.marker_dir("kill9")
    handle = fan_out("sleepy", "cpu0,cpu1", kwargs={"seconds": 2, "marker": inside}, app=fleet_host.app)
    job = handle.task_ids["cpu0"]
    wait_for(lambda: _markers(host_dir / job) == ["start"], 60, "cpu0's job to start")
    pid = fleet_host.main_pid(unit)
    fleet_host.box.run("kill", "-9", str(pid))
    results = handle.get(timeout=90)
    assert {d: e["status"] for d, e in results.items()} == {"cpu0": "ok", "cpu1": "ok"}
    assert _markers(host_dir / job) == ["start", "start", "end"]  # killed once, ran again, once
    show = fleet_host.box.show(unit, "NRestarts", "MainPID")
    assert int(show["NRestarts"]) == restarts + 1 and int(show["MainPID"]) != pid
    assert "status=9/KILL" in fleet_host.box.journal(unit)
    fleet_host.wait_ready()


# -- 3. stopping during a job ----------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_stop_under_systemd_lets_the_job_finish_and_sigquit_stops_at_once(fleet_host: Host) -> None:
    box, unit = fleet_host.box, WORKERS[0]
    host_dir, inside = fleet_host.marker_dir("stop")
    handle = fan_out("sleepy", "cpu0", kwargs={"seconds": 3, "marker": inside}, app=fleet_host.app)
    job = handle.task_ids["cpu0"]
    wait_for(lambda: _markers(host_dir / job) == ["start"], 60, "the job to start")
    box.systemctl("stop", unit)  # returns once the unit has stopped
    # Warm shutdown: the job finished and its result was stored before the process exited.
    assert _markers(host_dir / job) == ["start", "end"]
    assert handle.states() == {"cpu0": "SUCCESS"}
    show = box.show(unit, "ActiveState", "ExecMainStatus", "Result")
    assert show == {"ActiveState": "inactive", "ExecMainStatus": "0", "Result": "success"}
    box.systemctl("start", unit)
    fleet_host.wait_ready()

    handle = fan_out("sleepy", "cpu0", kwargs={"seconds": 3, "marker": inside}, app=fleet_host.app)
    job = handle.task_ids["cpu0"]
    wait_for(lambda: _markers(host_dir / job) == ["start"], 60, "the second job to start")
    restarts, pid = int(box.show(unit, "NRestarts")["NRestarts"]), fleet_host.main_pid(unit)
    box.systemctl("kill", "-s", "SIGQUIT", unit)
    # Celery's cold shutdown exits 1 at once: a failure, so systemd restarts the unit.
    wait_for(lambda: int(box.show(unit, "NRestarts")["NRestarts"]) == restarts + 1, 30,
             "systemd to restart the unit after SIGQUIT")
    assert fleet_host.main_pid(unit) != pid
    assert "status=1/FAILURE" in box.journal(unit)
    assert handle.get(timeout=90)["cpu0"]["status"] == "ok"
    assert _markers(host_dir / job) == ["start", "start", "end"]
    fleet_host.wait_ready()


# -- 4. configuration errors -----------------------------------------------------------------------


@pytest.mark.parametrize("setting, named", [("DEVICEFLEET_LEASE_TTL_S=banana", "banana"),
                                            ("DEVICEFLEET_JOB_MODULES=tasks.jobs,no_such_jobs", "no_such_jobs")])
def test_a_configuration_error_under_systemd_exits_2_and_is_not_restarted(fleet_host: Host, setting: str,
                                                                          named: str) -> None:
    box, unit = fleet_host.box, WORKERS[1]
    restarts = int(box.show(unit, "NRestarts")["NRestarts"])
    try:
        # As if an operator mistyped a value in the environment files (a later file wins).
        (fleet_host.etc / "devicefleet" / "broken.env").write_text(setting + "\n")
        fleet_host.dropin(unit, "90-broken.conf", "[Service]\nEnvironmentFile=/etc/devicefleet/broken.env\n")
        box.systemctl("restart", unit)
        wait_for(lambda: box.show(unit, "ActiveState")["ActiveState"] == "failed", 60,
                 "the unit to fail (not to be scheduled for a restart)")
        show = box.show(unit, "ExecMainStatus", "NRestarts", "Result")
        assert show == {"ExecMainStatus": "2", "NRestarts": str(restarts), "Result": "exit-code"}
        assert named in box.journal(unit)  # the journal names the bad value
    finally:
        fleet_host.dropin(unit, "90-broken.conf", None)
        box.systemctl("reset-failed", unit, check=False)
        box.systemctl("start", unit)
    fleet_host.wait_ready()


# -- 5. hardening ------------------------------------------------------------------------------------


def test_hardening_holds_under_systemd(fleet_host: Host) -> None:
    box = fleet_host.box
    for unit in (WORKERS[0], "devicefleet-flower.service", "devicefleet-metrics.service"):
        out = box.run("systemd-analyze", "security", "--no-pager", unit, check=False).stdout
        level = exposure_level(out)
        assert level <= 2.0, f"{unit}: {level}"
    writes = [str(STATE / "job-was-here"), str(STATE / "artifacts" / "job-was-here"), "/etc/job-was-here",
              "/usr/job-was-here", "/var/job-was-here", str(ROOT / "job-was-here"), "/tmp/job-was-here"]
    entry = fan_out("sandbox", "cpu0", kwargs={"write": writes}, app=fleet_host.app).get(timeout=60)["cpu0"]
    assert entry["status"] == "ok", entry["error"]
    got = entry["output"]["writes"]
    assert got == {writes[0]: "ok", writes[1]: "ok", writes[2]: "EROFS", writes[3]: "EROFS",
                   writes[4]: "EROFS", writes[5]: "EROFS", writes[6]: "ok"}, got
    assert (fleet_host.state / "job-was-here").is_file()
    assert box.run("test", "-e", "/tmp/job-was-here", check=False).returncode == 1  # its own /tmp
    # /proc hides other users' processes from the job: not Redis's, not PID 1's; its own shows.
    visible = entry["output"]["visible_pids"]
    assert entry["output"]["pid"] in visible
    assert fleet_host.main_pid("redis-server.service") not in visible and 1 not in visible
    # torch, a DataLoader with worker processes and psutil run under the system-call filter.
    trained = fan_out("train", "cpu0", kwargs={"epochs": 2, "num_workers": 2}, app=fleet_host.app).get(timeout=90)
    assert trained["cpu0"]["status"] == "ok", trained["cpu0"]["error"]
    assert trained["cpu0"]["output"]["num_workers"] == 2


def test_a_job_under_systemd_reads_neither_the_environment_files_nor_a_fleet_process(fleet_host: Host) -> None:
    """On a deployed host the jobs run as the fleet's own user, who may read devicefleet.env and
    flower.env (root:devicefleet 0640): systemd reads the first for the worker, which then closes
    both to itself and its jobs; the worker, Flower and the exporter (same user) are non-dumpable,
    which ProtectProc=invisible turns into not being there for a job (tests/scripts/snoop.py)."""
    box, plan = fleet_host.box, fleet_host.plan
    files = [plan.config_dir / "devicefleet.env", plan.config_dir / "flower.env"]
    # As `devicefleet deploy`'s commands leave them: root:devicefleet 0640 (the container's
    # group, set on the host file the container binds).
    group = int(box.run("id", "-g", "devicefleet").stdout)
    host_files = [fleet_host.etc / "devicefleet" / f.name for f in files]
    for path in host_files:
        os.chown(path, 0, group)
    try:
        # The premise: the fleet's user may read them, outside the worker's unit.
        shown = box.run("setpriv", "--reuid=devicefleet", "--regid=devicefleet", "--clear-groups", "cat",
                        *map(str, files)).stdout
        assert plan.redis_url in shown and plan.flower_auth in shown
        needles = [plan.redis_url, plan.redis_password, plan.flower_auth, plan.flower_auth.partition(":")[2]]
        entry = fan_out("snoop", "cpu0", kwargs={"needles": needles, "paths": list(map(str, files))},
                        app=fleet_host.app).get(timeout=60)["cpu0"]
    finally:
        for path in host_files:
            os.chown(path, 0, 0)
    assert entry["status"] == "ok", entry["error"]
    report = entry["output"]["snoop"]
    assert report["found"] == [] and report["urls"] == [] and report["reached"] == [], report
    assert {report["closed"][f"file {f}"] for f in files} == {"PermissionError"}, report["closed"]
    # ... while the worker has its variables: its parent, the unit's main process, is in the
    # fleet's registry (it reached Redis with the URL from that file), its environ closed.
    worker = fleet_host.main_pid(WORKERS[0])
    assert report["ppid"] == worker and live_devices(fleet_host.app)["cpu0"].pid == worker
    # ProtectProc=invisible shows a job only the processes it may ptrace: the worker, and every
    # other fleet process (same user, each non-dumpable) are not even there for it to open...
    assert report["closed"]["/proc/parent/environ"] == "FileNotFoundError", report["closed"]
    others = {unit: fleet_host.main_pid(unit)
              for unit in (WORKERS[1], "devicefleet-flower.service", "devicefleet-metrics.service")}
    seen = report["processes"]
    assert {unit: str(pid) in seen for unit, pid in others.items()} == {unit: False for unit in others}, seen
    # ... while the other worker's job processes (same user, dumpable) are, read, and hold nothing.
    jobs = {str(pid) for pid in live_devices(fleet_host.app)["cpu1"].job_pids}
    assert jobs and {seen[pid]["environ"] for pid in jobs} == {"read"}, (jobs, seen)


PROBE = ("import errno, os, socket\n"
         "for path in ('/dev/nvidia0', '/dev/nvidia1'):\n"
         "    try:\n"
         "        os.close(os.open(path, os.O_RDWR)); print(path, 'opened')\n"
         "    except OSError as exc:\n"
         "        print('devprobe', path, errno.errorcode[exc.errno])\n"
         "leader = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
         "try:\n"
         "    leader.connect('/run/devicefleet/groups/gpu0.sock'); print('devprobe connect opened')\n"
         "except OSError as exc:\n"
         "    print('devprobe connect', errno.errorcode[exc.errno])\n")


@pytest.mark.timeout(180)
def test_gpu_units_open_their_own_card_and_a_group_job_its_groups_cards_under_systemd(fleet_host: Host,
                                                                                    tmp_path: Path) -> None:
    """Stand-in device nodes (no NVIDIA driver here), units rendered for a host with two GPUs.
    gpu0's worker, the group's leader (tests/scripts/group_leader.py in its place: the worker's own
    Supervisor.run with apart), runs a group job over gpu0 and gpu1: its job process, the group host's child in
    devicefleet-groups.service, gets past the device cgroup for both cards (ENXIO: no driver
    behind them), while the leader itself is stopped at gpu1's (EPERM). A single-device unit,
    gpu1's, opens its own card only and cannot reach the leader's socket (EACCES: hidden from
    every worker unit); a CPU instance sees neither node (ENOENT, PrivateDevices)."""
    box, units = fleet_host.box, fleet_host.units
    for index in (0, 1):
        box.run("mknod", "-m", "0666", f"/dev/nvidia{index}", "c", "195", str(index), check=False)
    gpu_plan = plan_host(gpus=2, cpu_workers=1, root=tmp_path, worker_configs_src=ROOT / "worker_configs",
                         devicefleet_bin=fleet_host.plan.devicefleet_bin)
    render(gpu_plan, tmp_path)
    rendered = tmp_path / "etc/systemd/system"
    probe = (f"[Service]\nType=oneshot\nRestart=no\nExecStart=\n"
             f"ExecStart={sys.executable} -c \"exec(bytes.fromhex('{PROBE.encode().hex()}'))\"\n")
    leader = (f"[Service]\nType=oneshot\nRestart=no\nTimeoutStartSec=120\nExecStart=\n"
              f"ExecStart={sys.executable} {ROOT / 'tests/scripts/group_leader.py'} {STATE}\n")
    workers = {d: f"devicefleet-worker@{d}.service" for d in ("gpu0", "gpu1", "cpu7")}
    host = "devicefleet-groups.service"
    installed = [units / host, units / "devicefleet-worker@.socket"]
    seen: dict[str, list[str]] = {}
    try:
        for path in installed:
            path.write_text((rendered / path.name).read_text())
        # The checkout's code for the group host, as the rendered environment file gives the workers.
        fleet_host.dropin(host, "90-checkout.conf", f"[Service]\nEnvironment=PYTHONPATH={ROOT}\n")
        for gpu in ("gpu0", "gpu1"):
            for name in ("20-gpu.conf", "25-groups.conf"):
                fleet_host.dropin(workers[gpu], name, (rendered / f"{workers[gpu]}.d" / name).read_text())
        for device in ("gpu1", "cpu7"):
            fleet_host.dropin(workers[device], "99-probe.conf", probe)
        fleet_host.dropin(workers["gpu0"], "99-probe.conf", leader)
        box.systemctl("start", host)
        host_pid = fleet_host.main_pid(host)
        for device in ("gpu1", "cpu7", "gpu0"):
            box.systemctl("start", workers[device], check=False)
            seen[device] = sorted(line.split(" ", 1)[1] for line in box.journal(workers[device]).splitlines()
                                  if line.startswith("devprobe "))
        run = [line.split(" ", 1)[1] for line in box.journal(workers["gpu0"]).splitlines()
               if line.startswith("grouprun ")]
        leader_result = box.show(workers["gpu0"], "Result")["Result"]
    finally:
        box.systemctl("stop", host, "devicefleet-worker@gpu0.socket", "devicefleet-worker@gpu1.socket", check=False)
        for unit in workers.values():
            fleet_host.dropin(unit, "99-probe.conf", None)
        for gpu in ("gpu0", "gpu1"):
            for name in ("20-gpu.conf", "25-groups.conf"):
                fleet_host.dropin(workers[gpu], name, None)
        fleet_host.dropin(host, "90-checkout.conf", None)
        for path in installed:
            path.unlink(missing_ok=True)
        box.systemctl("daemon-reload")
    assert leader_result == "success", box.journal(workers["gpu0"])[-3000:]
    assert seen["gpu0"] == ["group /dev/nvidia0 ENXIO", "group /dev/nvidia1 ENXIO",
                            "leader /dev/nvidia0 ENXIO", "leader /dev/nvidia1 EPERM"], seen
    uid = int(box.run("id", "-u", "devicefleet").stdout)
    assert len(run) == 1 and json.loads(run[0]) == {"ppid": host_pid, "uid": uid, "cuda_visible_devices": "0,1"}, run
    assert seen["gpu1"] == ["/dev/nvidia0 EPERM", "/dev/nvidia1 ENXIO", "connect EACCES"], seen
    assert seen["cpu7"] == ["/dev/nvidia0 ENOENT", "/dev/nvidia1 ENOENT", "connect EACCES"], seen


# -- 6. restarting the whole fleet -----------------------------------------------------------------


@pytest.mark.timeout(150)
def test_restarting_the_target_under_systemd_loses_no_queued_job(fleet_host: Host) -> None:
    host_dir, inside = fleet_host.marker_dir("restart")
    running = fan_out("sleepy", "cpu0,cpu1", kwargs={"seconds": 2, "marker": inside}, app=fleet_host.app)
    queued = [fan_out("echo", "cpu0,cpu1", kwargs={"value": i}, app=fleet_host.app) for i in range(10)]
    wait_for(lambda: all(_markers(host_dir / j) == ["start"] for j in running.task_ids.values()), 60,
             "both running jobs to start")
    pids = {u: fleet_host.main_pid(u) for u in WORKERS}
    fleet_host.box.systemctl("restart", "devicefleet.target")
    assert all(fleet_host.main_pid(u) not in (0, pids[u]) for u in WORKERS)  # really restarted
    assert {d: e["status"] for d, e in running.get(timeout=60).items()} == {"cpu0": "ok", "cpu1": "ok"}
    for job in running.task_ids.values():
        assert _markers(host_dir / job) == ["start", "end"]  # finished before the stop, once
    for i, handle in enumerate(queued):
        got = handle.get(timeout=90)
        assert {d: e["output"]["value"] for d, e in got.items()} == {"cpu0": i, "cpu1": i}
    fleet_host.wait_ready()


# -- 9. each user's jobs as the user's own system account ----------------------------------------


@pytest.mark.timeout(240)
def test_each_users_jobs_run_as_their_own_account_and_cannot_read_another_users_files_under_systemd(
        fleet_host: Host, tmp_path: Path) -> None:
    """`devicefleet deploy --job-account alice --job-account bob`, on cpu1: alice's job writes
    in her folder, bob's job (same device, same worker) can neither read it nor write there;
    each runs as its user's account with no capability, while the worker, unprivileged, holds
    only what starting them takes and ends her hung and crashed jobs' processes; a user of the
    fleet with no account is refused, and the admin's job still runs as the worker's account."""
    box, plan = fleet_host.box, fleet_host.plan
    unit, device = WORKERS[1], "cpu1"
    rendered = tmp_path / "rendered"
    render(dataclasses.replace(plan, job_users=("alice", "bob")), rendered)
    for name in ("sysusers.d/devicefleet.conf", "tmpfiles.d/devicefleet.conf"):
        (fleet_host.etc / name).write_text((rendered / "etc" / name).read_text())
    box.run("systemd-sysusers")
    box.run("systemd-tmpfiles", "--create", "/etc/tmpfiles.d/devicefleet.conf")
    fleet_host.dropin(unit, "40-job-accounts.conf", (
        rendered / "etc/systemd/system/devicefleet-worker@cpu1.service.d/40-job-accounts.conf").read_text())
    admin = connect(plan.redis_url)
    users = ("alice", "bob", "carol")
    try:
        box.systemctl("restart", unit)
        fleet_host.wait_ready()
        apps = {}
        for user in users:
            add_user(admin, plan.redis_url, user, output=tmp_path / f"{user}.json")
            apps[user] = create_app(Settings.load(credentials=tmp_path / f"{user}.json", state_dir=tmp_path / user,
                                                  job_modules=["tasks.jobs", "tests.fleet_jobs"]))
        ids = {user: int(box.run("id", "-u", f"devicefleet-{user}").stdout) for user in ("alice", "bob")}
        ids["devicefleet"] = int(box.run("id", "-u", "devicefleet").stdout)
        alice_folder = STATE / "artifacts" / "users" / "alice"
        secret = str(alice_folder / "secret.txt")

        def sandbox(user: str, **kwargs: Any) -> dict[str, Any]:
            app = fleet_host.app if user == "admin" else apps[user]
            return dict(fan_out("sandbox", device, kwargs=kwargs, app=app).get(timeout=90)[device])

        alice = sandbox("alice", write=[secret])
        assert alice["status"] == "ok", alice["error"]
        out = alice["output"]
        assert (out["uid"], out["writes"]) == (ids["alice"], {secret: "ok"}), out
        assert set(out["groups"]) <= {out["gid"]} and out["home"] == str(alice_folder), out
        assert out["artifacts_dir"].startswith(f"{alice_folder}/"), out
        assert set(out["capabilities"].values()) == {0}, out["capabilities"]
        on_disk = (fleet_host.state / "artifacts" / "users" / "alice" / "secret.txt").stat()
        assert (on_disk.st_uid, stat.S_IMODE(on_disk.st_mode)) == (ids["alice"], 0o600)
        # bob's job, on the same device, right after: his account, and alice's file closed to it.
        shared = str(STATE / "artifacts" / "bob-was-here")
        bob = sandbox("bob", read=[secret], write=[str(alice_folder / "bob-was-here"), shared])
        assert bob["status"] == "ok", bob["error"]
        assert bob["output"]["uid"] == ids["bob"] and bob["output"]["pid"] != out["pid"]
        assert bob["output"]["reads"] == {secret: "EACCES"}, bob["output"]
        assert bob["output"]["writes"] == {str(alice_folder / "bob-was-here"): "EACCES", shared: "EACCES"}
        # Alice's warm process lives on beside bob's, hidden from his job (ProtectProc=invisible);
        # her next job reads her file in it: a user's own jobs still reuse their warm process.
        alices = {int(pid) for pid in box.run("ps", "-u", "devicefleet-alice", "-o", "pid=").stdout.split()}
        assert out["pid"] in alices and not alices & set(bob["output"]["visible_pids"]), (alices, bob["output"])
        again = sandbox("alice", read=[secret])["output"]
        assert (again["reads"], again["pid"]) == ({secret: "ok"}, out["pid"])
        # The worker measured her jobs' CPU time (devicefleet usage): it reads her processes' /proc
        # entries, which ProtectProc=invisible hides from other users but CAP_SYS_PTRACE opens.
        def alices_busy() -> float | None:
            rows = {(row.name, row.kind): row for row in read_fleet_usage(admin)}
            return rows[("alice", "cpu")].busy_s if ("alice", "cpu") in rows else None

        busy = fan_out("probe", device, kwargs={"busy_s": 0.5}, app=apps["alice"]).get(timeout=60)[device]
        assert busy["status"] == "ok" and busy["output"]["pid"] == out["pid"], busy
        assert wait_for(alices_busy, 30, "alice's usage with her jobs' busy seconds") > 0
        # Her job that hangs past its time limit, and one that crashes: the worker, another
        # account, ends the first's process and its subprocess (CAP_KILL), and her next job runs
        # in a fresh process of hers.
        marker = alice_folder / "hang"
        hung = fan_out("hang", device, kwargs={"marker": str(marker)}, options={"time_limit_s": 1},
                       app=apps["alice"]).get(timeout=60)[device]
        assert hung["status"] == "error" and hung["error"]["type"] == "JobTimeout", hung
        job_pid, sub_pid = (fleet_host.state / "artifacts" / "users" / "alice" / "hang").read_text().split()
        assert job_pid == str(out["pid"])  # her warm process ran it
        assert wait_for(lambda: box.run("ps", "-p", f"{job_pid},{sub_pid}", check=False).returncode == 1, 30,
                        "her hung job's process and its subprocess to end")
        crashed = fan_out("crash", device, app=apps["alice"]).get(timeout=60)[device]
        assert crashed["status"] == "error" and crashed["error"]["type"] == "JobCrashed", crashed
        assert "killed by SIGSEGV" in crashed["error"]["message"], crashed
        crashed_pid = int(re.search(r"about to crash \(segv\) in (\d+)", crashed["error"]["message"])[1])
        after = sandbox("alice", read=[secret])["output"]
        assert after["uid"] == ids["alice"] and after["reads"] == {secret: "ok"}
        assert len({out["pid"], crashed_pid, after["pid"]}) == 3, (out["pid"], crashed_pid, after)
        # A user of the fleet whom the host gives no account: refused, saying what to do.
        carol = sandbox("carol")
        assert carol["status"] == "error" and carol["error"]["type"] == "NoJobAccount", carol
        assert "--job-account carol" in carol["error"]["message"]
        # The admin's job (the fleet's password, no user of the fleet) runs as the worker's account.
        assert sandbox("admin")["output"]["uid"] == ids["devicefleet"]
        # The worker: unprivileged, holding exactly what starting and watching them takes.
        worker = fleet_host.main_pid(unit)
        held = held_capabilities(box.run("cat", f"/proc/{worker}/status").stdout)
        wanted = sum(1 << bit for bit in CAPABILITY_NUMBERS.values())
        assert (held["CapEff"], held["CapAmb"]) == (wanted, wanted), held
        assert box.run("ps", "-o", "user=", "-p", str(worker)).stdout.strip() == "devicefleet"
    finally:
        for user in users:
            remove_user(admin, user, plan.redis_url)
        admin.close()
        fleet_host.dropin(unit, "40-job-accounts.conf", None)
        box.systemctl("restart", unit)
        fleet_host.wait_ready()
