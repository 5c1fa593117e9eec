"""A device worker's life as Celery bootsteps (tasks/worker/steps.py): the order its services
start and stop in, and what that order guarantees on real workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from celery.utils.imports import symbol_by_name

from tasks import fan_out
from tasks.core import keys
from tasks.core.app import CONSUMER_STEP, WORKER_STEPS, create_app
from tasks.core.registry import connect, read_worker
from tasks.worker import steps

from .conftest import TEST_JOB_MODULES, cli_env, standalone_worker, wait_for

#: Short enough that a lease or record nobody renews is gone within the test.
TTL_S = 1.5


def _required(step: type) -> set[str]:
    """The names of every step ``step`` requires, directly or through another."""
    found: set[str] = set()
    todo = [symbol_by_name(dep) for dep in step.requires]
    while todo:
        dep = todo.pop()
        if dep.name not in found:
            found.add(dep.name)
            todo.extend(symbol_by_name(d) for d in dep.requires)
    return found


def test_the_app_adds_every_worker_step_and_each_starts_after_what_it_uses():
    app = create_app(main="devicefleet-steps-test")
    assert set(app.steps["worker"]) == set(WORKER_STEPS) and app.steps["consumer"] == {CONSUMER_STEP}
    loaded = {symbol_by_name(name) for name in WORKER_STEPS}
    assert {step.__module__ for step in loaded} == {"tasks.worker.steps"}
    # Celery starts a step after every step it requires and stops it before them (in reverse).
    uses = {
        steps.DeviceStep: ["celery.worker.components.Pool"],
        steps.JobProcessesStep: [steps.DeviceStep.name],
        steps.SlotsStep: [steps.JobProcessesStep.name],
        steps.RegistryStep: [steps.SlotsStep.name],
        steps.LeaseStep: [steps.RegistryStep.name],
        # The health service writes the device's state with the registry's client.
        steps.HealthStep: [steps.RegistryStep.name],
        steps.ReaperStep: [steps.RegistryStep.name],
        steps.CancelRelayStep: [steps.RegistryStep.name],
        steps.AclUsersStep: [steps.RegistryStep.name],
        steps.PreemptionStep: [steps.SlotsStep.name, steps.RegistryStep.name],
        # Out of service, the consumer takes nothing from the jobs' first BRPOP on.
        steps.ServiceStep: [steps.RegistryStep.name],
        # Stopped before the heartbeat, the lease keeper and the reaper: a job finishing within its
        # stop timeout is stored with its lease while they still run.
        steps.JobsStep: [steps.LeaseStep.name, steps.ReaperStep.name, steps.CancelRelayStep.name,
                         steps.AclUsersStep.name, steps.RegistryStep.name,
                         steps.JobProcessesStep.name, steps.PreemptionStep.name, steps.HealthStep.name,
                         steps.ServiceStep.name],
        steps.StopHandlersStep: [steps.JobsStep.name],
        # Stopped before the jobs step drains: a single job still waiting at a closed gate goes
        # back to its queue, none starts on a device held for a group.
        steps.GroupsStep: [steps.JobsStep.name],
    }
    assert set(uses) == loaded
    for step, required in uses.items():
        assert set(required) <= _required(step), f"{step.name} does not require {required}"
    assert "celery.worker.consumer.tasks.Tasks" in _required(steps.ConsumerReadyStep)


@pytest.mark.timeout(120)
def test_a_warm_stop_keeps_the_heartbeat_and_the_lease_while_the_running_job_finishes(fleet, app, tmp_path):
    client = connect(fleet.redis_url)
    log = tmp_path / "cpu8.log"
    argv = [sys.executable, "-m", "tasks", "worker", "cpu8"]
    try:
        with standalone_worker(fleet, "cpu8", argv, log, DEVICEFLEET_STATE_DIR=str(tmp_path / "state"),
                               DEVICEFLEET_LEASE_TTL_S=str(TTL_S), DEVICEFLEET_HEARTBEAT_TTL_S=str(TTL_S),
                               DEVICEFLEET_HEARTBEAT_INTERVAL_S="0.3") as (proc, _):
            release = tmp_path / "release"
            handle = fan_out("hold", ["cpu8"], kwargs={"release_file": str(release)}, app=app)
            lease = keys.lease(handle.task_ids["cpu8"])
            wait_for(lambda: client.exists(lease), 60, "the job to take its lease", proc=proc)
            proc.send_signal(signal.SIGTERM)  # systemctl stop: a warm shutdown
            wait_for(lambda: "SIGTERM: warm shutdown" in log.read_text(), 30, "the worker to begin its stop")
            stopping = time.time()
            # A heartbeat written more than a TTL after the stop began: without it the record, and
            # without the lease keeper the lease, would have expired by then (and another worker's
            # reaper would have sent the job again).
            wait_for(lambda: (r := read_worker(client, "cpu8")) is not None and r.heartbeat_at is not None
                     and r.heartbeat_at > stopping + TTL_S, 30, "a heartbeat during the stop", proc=proc)
            assert client.pttl(lease) > 0, "the lease expired while its job still ran"
            assert not handle.results()["cpu8"].ready()
            release.touch()
            entry = handle.get(timeout=60)["cpu8"]
            assert entry["status"] == "ok", entry
            assert proc.wait(60) == 0
        # The job's end was stored with its lease released, and the worker left the registry.
        assert client.exists(lease) == 0
        assert read_worker(client, "cpu8") is None
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_worker_whose_device_is_taken_exits_2_and_leaves_the_owners_record(fleet, tmp_path):
    client = connect(fleet.redis_url)
    try:
        owner = read_worker(client, "cpu0")
        assert owner is not None
        env = cli_env(DEVICEFLEET_REDIS_URL=fleet.redis_url, DEVICEFLEET_CORES="0",
                      DEVICEFLEET_JOB_MODULES=",".join(TEST_JOB_MODULES), DEVICEFLEET_STATE_DIR=str(tmp_path))
        worker = subprocess.run([sys.executable, "-m", "tasks", "worker", "cpu0"], env=env, capture_output=True,
                                text=True, timeout=100)
        assert worker.returncode == 2, worker.stdout[-2000:] + worker.stderr[-2000:]
        assert f"device cpu0 is already in the fleet as {owner.worker}" in worker.stderr
        after = read_worker(client, "cpu0")
        assert after is not None and after.pid == owner.pid and after.started_at == owner.started_at
    finally:
        client.close()

