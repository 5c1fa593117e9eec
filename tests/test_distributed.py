"""Distributed jobs against a real fleet: two CPU workers as the ranks of one gloo group.

The fleet here is supervised as ``devicefleet up`` supervises it, with short leases, because a
test kills a rank's worker. ``ranked`` (tests/fleet_jobs.py) is a rank that only all-reduces;
``train`` is the built-in job with DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

import tasks
from tasks import fan_out
from tasks.core import keys
from tasks.core.errors import ConfigError

from .conftest import make_settings, supervised_fleet, test_env, wait_for

LEASE_TTL_S = 3.0
HEARTBEAT_TTL_S = 2.0


@pytest.fixture(scope="module")
def dfleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    settings = make_settings(tmp_path_factory.mktemp("dfleet"), lease_ttl_s=LEASE_TTL_S, reaper_interval_s=0.5,
                             heartbeat_interval_s=0.5, heartbeat_ttl_s=HEARTBEAT_TTL_S)
    with supervised_fleet(settings) as running:
        yield running


@pytest.fixture(scope="module")
def dapp(dfleet):  # type: ignore[no-untyped-def]
    return dfleet.app()


def _ok(results: dict[str, dict]) -> None:  # type: ignore[type-arg]
    assert {d: e["status"] for d, e in results.items()} == {d: "ok" for d in results}, results


@pytest.mark.timeout(120)
def test_two_ranks_train_one_model_on_digits(dapp):
    results = fan_out("train", "cpu0,cpu1", kwargs={"epochs": 12}, distributed=True, app=dapp).get(timeout=100)
    _ok(results)
    out = {d: e["output"] for d, e in results.items()}
    assert [out["cpu0"]["rank"], out["cpu1"]["rank"]] == [0, 1]
    assert {o["world_size"] for o in out.values()} == {2}
    assert {o["backend"] for o in out.values()} == {"gloo"}
    # One model: every rank ends with the same parameters, and it learned digits.
    assert out["cpu0"]["weights_digest"] == out["cpu1"]["weights_digest"]
    assert out["cpu0"]["accuracy"] == out["cpu1"]["accuracy"] >= 0.9
    # Each rank trained on its half of the data; only rank 0 wrote the checkpoint.
    assert out["cpu0"]["samples_seen"] + out["cpu1"]["samples_seen"] >= out["cpu0"]["train_samples"] * 12
    assert out["cpu0"]["samples_seen"] < out["cpu0"]["train_samples"] * 12
    assert Path(out["cpu0"]["checkpoint"]).is_file() and out["cpu1"]["checkpoint"] is None
    # Every rank saw the same (rank-averaged) loss curve.
    assert out["cpu0"]["history"] == out["cpu1"]["history"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_ranks_train_with_nccl_and_beside_a_cpu_rank_with_gloo(dapp):
    """On a GPU host: the GPU workers alone form an nccl group, each rank on its own card; a
    gang of cpu0 and a GPU rank gets gloo (``auto``: nccl cannot take a CPU rank) and trains one
    model across both kinds of device."""
    gpus = sorted(d for d, r in tasks.live_devices(dapp).items() if r.kind == "gpu")
    assert gpus, "a GPU host runs a GPU worker"
    results = fan_out("train", gpus, kwargs={"epochs": 8}, distributed={"backend": "nccl"},
                      app=dapp).get(timeout=240)
    _ok(results)
    for device, entry in results.items():
        assert entry["output"]["backend"] == "nccl" and entry["output"]["world_size"] == len(gpus)
        assert entry["output"]["torch_device"] == "cuda:0"  # each worker sees only its own card
        assert entry["visibility"]["cuda_visible_devices"] == device.removeprefix("gpu")
    assert len({e["output"]["weights_digest"] for e in results.values()}) == 1
    assert results[gpus[0]]["output"]["accuracy"] >= 0.9

    mixed = fan_out("train", ["cpu0", gpus[0]], kwargs={"epochs": 8}, distributed=True,
                    app=dapp).get(timeout=240)
    _ok(mixed)
    out = {d: e["output"] for d, e in mixed.items()}
    assert {o["backend"] for o in out.values()} == {"gloo"}
    assert out["cpu0"]["torch_device"] == "cpu" and out[gpus[0]]["torch_device"] == "cuda:0"
    assert out["cpu0"]["accuracy"] == out[gpus[0]]["accuracy"] >= 0.9  # one evaluation, summed over ranks
    assert out["cpu0"]["history"] == out[gpus[0]]["history"]


@pytest.mark.timeout(60)
def test_ranks_get_torchrun_variables_and_keep_their_own_device(dapp):
    results = fan_out("ranked", "cpu1,cpu0", kwargs={"steps": 2}, distributed=True, app=dapp).get(timeout=40)
    _ok(results)
    out = {d: e["output"] for d, e in results.items()}
    assert out["cpu1"]["rank"] == 0 and out["cpu0"]["rank"] == 1  # rank i runs on the i-th device named
    assert {o["sum"] for o in out.values()} == {3.0}  # 1 + 2, reduced over the group
    for device, o in out.items():
        env = o["env"]
        assert env["RANK"] == str(o["rank"]) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["CUDA_VISIBLE_DEVICES"] == "-1"
        assert results[device]["visibility"]["cuda_visible_devices"] == "-1"
        assert o["initialized"] is True and o["restarts"] == 0
    assert out["cpu0"]["env"]["MASTER_PORT"] == out["cpu1"]["env"]["MASTER_PORT"]
    # Both workers run on this host: local ranks 0 and 1, as torchrun numbers them.
    assert sorted(o["local_rank"] for o in out.values()) == [0, 1]
    # No rank holds the group after its job: a plain job on the same workers sees none.
    after = fan_out("ranked", "cpu0", kwargs={"steps": 0}, app=dapp).get(timeout=30)
    assert after["cpu0"]["output"]["initialized"] is False
    assert after["cpu0"]["output"]["env"]["RANK"] is None


@pytest.mark.timeout(90)
def test_two_gangs_sent_at_once_over_the_same_devices_both_complete(dapp):
    barrier = threading.Barrier(2)
    results: dict[str, dict] = {}  # type: ignore[type-arg]

    def send(order: str) -> None:
        barrier.wait()
        handle = fan_out("ranked", order, kwargs={"steps": 5, "seconds": 0.05}, distributed=True, app=dapp)
        results[order] = handle.get(timeout=60)

    threads = [threading.Thread(target=send, args=(order,)) for order in ("cpu0,cpu1", "cpu1,cpu0")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(70)
    assert set(results) == {"cpu0,cpu1", "cpu1,cpu0"}
    for gang in results.values():
        _ok(gang)
        assert {e["output"]["sum"] for e in gang.values()} == {3.0}


@pytest.mark.timeout(90)
def test_a_rank_gives_its_device_to_an_older_assembling_gang_and_comes_back(dfleet, dapp, tmp_path):
    """Wait-die through the real worker: an older gang (written here as its waiting ranks write
    it) needs cpu1; the new gang's rank on cpu1, waiting for cpu0 (busy), gives cpu1 up, its
    message goes back to the queue with its options, and once the older gang stops waiting and
    cpu0 is free, the gang runs."""
    client = redis.Redis.from_url(dfleet.redis_url)
    cpu1_log = dfleet.workers["cpu1"].log
    release = tmp_path / "release"
    busy = fan_out("hold", "cpu0", kwargs={"steps": 1, "release_file": str(release)}, app=dapp)
    wait_for(lambda: busy.states()["cpu0"] in ("STARTED", "PROGRESS"), 30, "cpu0 to be busy")

    def older_gang_waits_and_rank_gave_way() -> bool:
        client.set(keys.gang_alive("older-gang"), 1, px=2000)  # its ranks poll while they wait
        return "cpu1 is needed by the older gang older-gang" in cpu1_log.read_text()

    client.zadd(keys.device_claims("cpu1"), {"gang:older-gang": 0})
    client.set(keys.gang_alive("older-gang"), 1, px=2000)
    try:
        handle = fan_out("ranked", "cpu0,cpu1", kwargs={"steps": 2}, distributed=True, app=dapp)
        wait_for(older_gang_waits_and_rank_gave_way, 60, "the rank on cpu1 to give way", poll=0.1)
    finally:  # the older gang stops waiting, cpu0 is free again
        client.delete(keys.gang_alive("older-gang"))
        client.zrem(keys.device_claims("cpu1"), "gang:older-gang")
        client.close()
        release.touch()
    busy.get(timeout=30)
    results = handle.get(timeout=60)
    _ok(results)
    assert {e["output"]["sum"] for e in results.values()} == {3.0}
    assert "needed by the older gang" not in dfleet.workers["cpu0"].log.read_text()


@pytest.mark.timeout(90)
def test_a_rank_that_cannot_join_fails_the_gang_naming_its_device(dapp, tmp_path):
    release = tmp_path / "release"
    busy = fan_out("hold", "cpu1", kwargs={"steps": 1, "release_file": str(release)}, app=dapp)
    wait_for(lambda: busy.states()["cpu1"] in ("STARTED", "PROGRESS"), 30, "cpu1 to be busy")
    handle = fan_out("ranked", "cpu0,cpu1", kwargs={"steps": 1}, distributed={"join_timeout_s": 2}, app=dapp)
    wait_for(lambda: handle.states()["cpu0"] == "FAILURE", 30, "rank 0 to give up")
    release.touch()
    results = handle.get(timeout=60)
    busy.get(timeout=30)
    error = results["cpu0"]["error"]
    assert error["type"] == "GangFailed"
    assert "cpu1 did not join within join_timeout_s=2" in error["message"]
    assert results["cpu0"]["duration_s"] >= 2.0  # it waited the join timeout, then gave up
    # The late rank finds its gang failed and does not wait for anything.
    assert results["cpu1"]["error"]["type"] == "GangFailed"
    assert "cpu1 did not join" in results["cpu1"]["error"]["message"]


@pytest.mark.timeout(60)
def test_a_ranks_own_error_fails_the_gang_at_once_naming_it(dapp):
    results = fan_out("ranked", "cpu0,cpu1", kwargs={"steps": 3, "fail_rank": 1}, distributed=True,
                      app=dapp).get(timeout=40)
    assert results["cpu1"]["error"] == {"type": "ValueError", "message": "rank 1 fails on purpose"}
    assert results["cpu0"]["error"]["type"] == "GangFailed"
    assert "rank 1 on cpu1 failed: ValueError: rank 1 fails on purpose" in results["cpu0"]["error"]["message"]


@pytest.mark.timeout(90)
def test_a_rank_whose_process_crashes_is_a_lost_peer_and_its_gang_restarts(dapp, tmp_path):
    before = tasks.live_devices(dapp)
    results = fan_out("ranked", "cpu0,cpu1", kwargs={"steps": 3, "crash_rank": 1, "marker": str(tmp_path)},
                      distributed=True, app=dapp).get(timeout=80)
    _ok(results)
    assert {e["output"]["restarts"] for e in results.values()} == {1}  # the whole gang ran again, once
    assert {e["output"]["sum"] for e in results.values()} == {3.0}
    # Rank 1 ran twice, in two job processes of the same worker: its worker never went down.
    runs = [line.split() for line in (tmp_path / "cpu1").read_text().splitlines()]
    assert [restarts for _, restarts in runs] == ["0", "1"] and runs[0][0] != runs[1][0]
    assert tasks.live_devices(dapp)["cpu1"].pid == before["cpu1"].pid


@pytest.mark.timeout(180)
def test_a_killed_ranks_gang_restarts_from_its_checkpoint_and_completes(dfleet, dapp):
    handle = fan_out("train", "cpu0,cpu1", kwargs={"epochs": 40, "checkpoint_every_s": 0, "num_workers": 0},
                     distributed=True, app=dapp)
    rank0_dir = dfleet.settings.artifacts_path / handle.task_ids["cpu0"]
    wait_for(lambda: (rank0_dir / "resume.json").is_file() and handle.progress()["cpu1"].get("epoch", 0) >= 3,
             120, "the gang to train three epochs")
    victim = dfleet.workers["cpu1"]
    killed_pid = victim.process.pid
    victim.process.kill()  # rank 1's worker: SIGKILL mid-training

    results = handle.get(timeout=150)
    _ok(results)
    out = {d: e["output"] for d, e in results.items()}
    assert {o["restarts"] for o in out.values()} == {1}  # the whole gang ran again, once
    # From rank 0's last checkpoint, shared with the new rank 1.
    assert out["cpu0"]["resumed_from_epoch"] == out["cpu1"]["resumed_from_epoch"] >= 2
    assert out["cpu0"]["weights_digest"] == out["cpu1"]["weights_digest"]
    assert out["cpu0"]["epochs"] == 40 and out["cpu0"]["accuracy"] >= 0.9
    assert tasks.live_devices(dapp)["cpu1"].pid != killed_pid  # the restarted worker ran rank 1
    dfleet.wait_ready(60)


def test_distributed_options_are_checked_before_anything_is_sent(dapp):
    with pytest.raises(ConfigError, match="max_restarts"):
        fan_out("ranked", "cpu0,cpu1", distributed={"max_restarts": -1}, app=dapp)
    with pytest.raises(ConfigError, match="nccl.*cpu0, cpu1 are CPU devices"):
        fan_out("ranked", "cpu0,cpu1", distributed={"backend": "nccl"}, app=dapp)
    with pytest.raises(ConfigError, match="one job over several devices"):
        fan_out({"cpu0": "ranked", "cpu1": "echo"}, distributed=True, app=dapp)
    with pytest.raises(ConfigError, match="fallback"):
        fan_out("ranked", "cpu0,cpu1", options={"fallback": "cpu"}, distributed=True, app=dapp)



@pytest.mark.timeout(90)
def test_cli_runs_a_distributed_job(dfleet):
    env = {**os.environ, **test_env(), "DEVICEFLEET_REDIS_URL": dfleet.redis_url}
    cli = [sys.executable, "-m", "tasks", "run", "ranked", "--devices", "cpu0,cpu1"]
    done = subprocess.run([*cli, "--distributed", "--max-restarts", "0", "--json", "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [results[d]["output"]["rank"] for d in ("cpu0", "cpu1")] == [0, 1]
    misused = subprocess.run([*cli, "--backend", "gloo"], env=env, capture_output=True, text=True, timeout=60)
    assert misused.returncode == 2 and "go with --distributed" in misused.stderr


#: A rank of a ``@job`` that builds a DistributedDataParallel model, run by the job process's own
#: ``run_rank`` in a fresh interpreter (a gang of one, gloo), which then prints its threads' names.
RANK_THEN_THREADS = r"""
import json, os, sys
from pathlib import Path

import torch
from torch import nn

from tasks.core.job import JobContext
from tasks.core.wire import Rank
from tasks.jobproc.rank import run_rank


class Channel:
    def send(self, message):
        pass

    def ask(self, message):
        raise AssertionError(message)


def ddp_step(ctx, params):
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    model(torch.randn(8, 4)).sum().backward()
    return {}


rank = Rank(gang_id="g", rank=0, world_size=1, local_rank=0, generation=0, max_restarts=0, backend="gloo",
            collective_timeout_s=30, master_addr="127.0.0.1")
run_rank(ddp_step, JobContext(device="cpu0", torch_device="cpu", job_id="j", artifacts_dir=Path(sys.argv[1])),
         None, rank, Channel())
print(json.dumps(sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))))
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a process's threads from /proc")
def test_a_ranks_group_is_gone_with_its_threads_once_its_job_ends(tmp_path: Path) -> None:
    """Issue 51: a DDP model built after the group exists imports ``torch.distributed.nn``,
    whose defaults kept the group, and with it gloo's threads, alive past
    ``destroy_process_group`` until the interpreter's exit, where one of them could abort the
    process; the job process imports it first (``import_before_any_group``), so no gloo thread
    is left once the job has ended (before the fix: ``gloo_tcp_loop`` and two
    ``pt_gloo_runloop``)."""
    done = subprocess.run([sys.executable, "-c", RANK_THEN_THREADS, str(tmp_path)], capture_output=True, text=True,
                          timeout=50, env=test_env(), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [name for name in threads if "gloo" in name], threads
