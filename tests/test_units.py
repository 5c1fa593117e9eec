"""Unit tests of pure logic: settings, device names, core planning, worker configs, job specs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks import ConfigError, JobSpec, Settings, WorkerRecord
from tasks.core.devices import Device, DeviceKind, format_core_list, parse_core_list, plan_cores
from tasks.core.errors import DeviceUnavailable, InvalidJobArguments, NoFleetError, UnknownJob
from tasks.core.queues import worker_queues
from tasks.core.worker_config import WorkerConfig, load_worker_config
from tasks.jobproc.registry import JobRegistry, validate_kwargs
from tasks.producer.fanout import select_devices
from tasks.worker.device import device_from_nodename
from tasks.worker.jobs import JobCatalog

ROOT = Path(__file__).resolve().parent.parent


def test_settings_reject_a_non_redis_url_naming_it(monkeypatch):
    monkeypatch.setenv("DEVICEFLEET_REDIS_URL", "http://example:6379")
    with pytest.raises(ConfigError) as info:
        Settings.load()
    assert "DEVICEFLEET_REDIS_URL" in str(info.value) and "http://example:6379" in str(info.value)


def test_settings_redact_passwords_in_errors(monkeypatch):
    monkeypatch.setenv("DEVICEFLEET_REDIS_URL", "ftp://:s3cret@host")
    with pytest.raises(ConfigError) as info:
        Settings.load()
    assert "s3cret" not in str(info.value)


def test_settings_precedence_override_beats_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DEVICEFLEET_STATE_DIR", "/from/env")
    assert Settings.load().state_dir == Path("/from/env")
    assert Settings.load(state_dir=tmp_path).state_dir == tmp_path


def test_job_modules_from_a_comma_list(monkeypatch):
    monkeypatch.setenv("DEVICEFLEET_JOB_MODULES", "tasks.jobs, my_pkg.jobs")
    assert Settings.load().job_modules == ["tasks.jobs", "my_pkg.jobs"]
    monkeypatch.setenv("DEVICEFLEET_JOB_MODULES", "tasks.jobs,not a module")
    with pytest.raises(ConfigError, match="not a module"):
        Settings.load()


def test_no_fleet_error_says_how_to_start_one(tmp_path):
    with pytest.raises(NoFleetError, match="devicefleet up"):
        Settings.load(state_dir=tmp_path).resolve_redis_url()


@pytest.mark.parametrize("name,kind,index,visible", [
    ("cpu0", DeviceKind.CPU, 0, "-1"), ("cpu3", DeviceKind.CPU, 3, "-1"), ("gpu2", DeviceKind.GPU, 2, "2"),
])
def test_device_names(name, kind, index, visible):
    device = Device.parse(name)
    assert (device.kind, device.index, device.cuda_visible_devices, str(device)) == (kind, index, visible, name)


@pytest.mark.parametrize("bad", ["gpu", "tpu0", "cpu-1", "GPU0", "cpu0 ", ""])
def test_bad_device_names_are_refused_by_name(bad):
    with pytest.raises(ConfigError) as info:
        Device.parse(bad)
    assert repr(bad) in str(info.value)


def test_worker_name_must_start_with_a_device(tmp_path):
    settings = Settings.load(state_dir=tmp_path)
    assert device_from_nodename("gpu1@host", settings).name == "gpu1"
    with pytest.raises(ConfigError, match="celery@host"):
        device_from_nodename("celery@host", settings)
    hosts = Settings.load(state_dir=tmp_path, device_names="host")
    assert device_from_nodename("cpu0@hosta", hosts).name == "cpu0@hosta"


def test_queues_of_a_worker():
    assert worker_queues(Device.parse("gpu1"), ["extra"]) == ["device.gpu1", "gpu", "fleet", "extra"]


def test_core_lists_round_trip():
    assert parse_core_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert format_core_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ConfigError, match=re.escape(f"cores={bad!r} is not a CPU list")):
            parse_core_list(bad)


def test_core_plan_two_cpu_workers_on_two_cores():
    assert plan_cores([0, 1], 2, 0, 4) == {"cpu0": [0], "cpu1": [1]}


def test_core_plan_gpu_loader_cores_and_cpu_share():
    plan = plan_cores(list(range(16)), 1, 1, 4)
    assert plan == {"gpu0": [0, 1, 2, 3], "cpu0": list(range(4, 16))}
    plan = plan_cores(list(range(16)), 2, 4, 4)
    assert [len(plan[f"gpu{i}"]) for i in range(4)] == [2, 2, 2, 2]
    assert sorted(plan["cpu0"] + plan["cpu1"]) == list(range(8, 16))
    used = [c for cores in plan.values() for c in cores]
    assert len(used) == len(set(used)) == 16


def test_core_plan_with_fewer_cores_than_workers_shares_round_robin():
    assert plan_cores([0], 2, 1, 4) == {"gpu0": [0], "cpu0": [0], "cpu1": [0]}


def test_repository_worker_configs_are_valid():
    configs = ROOT / "worker_configs"
    assert load_worker_config(configs, Device.parse("cpu0")).kind is DeviceKind.CPU
    assert load_worker_config(configs, Device.parse("gpu3")).kind is DeviceKind.GPU


def test_cpu_worker_config_refuses_prefork_too(tmp_path):
    (tmp_path / "cpu.toml").write_text('kind = "cpu"\npool = "prefork"\n')
    with pytest.raises(ConfigError) as info:
        load_worker_config(tmp_path, Device.parse("cpu0"))
    assert "cpu.toml" in str(info.value) and "lease" in str(info.value)


def test_gpu_worker_config_refuses_prefork(tmp_path):
    (tmp_path / "gpu.toml").write_text('kind = "gpu"\npool = "prefork"\n')
    with pytest.raises(ConfigError) as info:
        load_worker_config(tmp_path, Device.parse("gpu0"))
    assert "gpu.toml" in str(info.value) and "prefork" in str(info.value)


def test_worker_config_names_the_file_and_the_bad_value(tmp_path):
    (tmp_path / "cpu.toml").write_text('kind = "cpu"\nslots = 0\n')
    with pytest.raises(ConfigError, match=r"cpu\.toml: slots=0"):
        load_worker_config(tmp_path, Device.parse("cpu0"))
    (tmp_path / "cpu1.toml").write_text('kind = "gpu"\n')
    with pytest.raises(ConfigError, match="configures cpu1"):
        load_worker_config(tmp_path, Device.parse("cpu1"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_worker_config(tmp_path, Device.parse("gpu0"))


def test_worker_config_defaults():
    config = WorkerConfig(kind=DeviceKind.CPU)
    assert (config.pool.value, config.slots, config.memory_gib, config.cores) == ("threads", 1, None, "auto")


def test_job_specs():
    assert JobSpec.of("train", {"epochs": 2}) == JobSpec(name="train", kwargs={"epochs": 2})
    assert JobSpec.of(("probe", {"busy_s": 1})).kwargs == {"busy_s": 1}
    assert JobSpec.of({"name": "probe"}).name == "probe"
    for bad in ("", "rm -rf /", ("probe", "notadict"), 42, {"name": "x", "extra": 1}):
        with pytest.raises(ConfigError, match=re.escape(repr(bad))):
            JobSpec.of(bad)  # type: ignore[arg-type]


def _record(device: str) -> WorkerRecord:
    kind = device.rstrip("0123456789")
    return WorkerRecord(device=device, kind=kind, worker=f"{device}@host", host="host", pid=1,
                        queues=[f"device.{device}", kind, "fleet"], cores=[0], pool="threads",
                        jobs=["probe"], started_at=0.0)


def test_select_devices():
    live = {d: _record(d) for d in ("cpu0", "cpu1", "gpu0")}
    assert select_devices("all", live) == ["cpu0", "cpu1", "gpu0"]
    assert select_devices("gpu", live) == ["gpu0"]
    assert select_devices("cpu1,gpu0", live) == ["cpu1", "gpu0"]
    assert select_devices(["cpu", "cpu0"], live) == ["cpu0", "cpu1"]
    with pytest.raises(DeviceUnavailable, match="gpu"):
        select_devices("gpu", {"cpu0": _record("cpu0")})
    with pytest.raises(ConfigError):
        select_devices("", live)


def test_job_registry_only_knows_allowlisted_modules():
    import tests.forbidden_jobs  # noqa: F401  (defined, but not allowed)

    registry = JobRegistry(["tasks.jobs"])
    assert registry.names == ["hogwild", "noop", "probe", "train"]
    assert [d.task_name for d in registry.definitions()] == ["devicefleet.hogwild", "devicefleet.noop",
                                                             "devicefleet.probe", "devicefleet.train"]
    # What a job process and a worker answer for a job outside the allowlist (tasks.worker.consumer).
    with pytest.raises(UnknownJob) as raised:
        registry.get("forbidden")
    refused = raised.value
    assert type(refused) is UnknownJob
    assert str(JobCatalog(registry.infos(), ["tasks.jobs"]).unknown("forbidden")) == str(refused)
    assert "unknown job 'forbidden'" in str(refused) and "probe, train" in str(refused)
    assert "tasks.jobs" in str(refused)
    with pytest.raises(ConfigError, match="no_such_module"):
        JobRegistry(["no_such_module"])


def test_kwargs_are_checked_against_the_jobs_schema():
    (probe,) = [d for d in JobRegistry(["tasks.jobs"]).definitions() if d.name == "probe"]
    assert validate_kwargs(probe, {"busy_s": 1}).busy_s == 1  # type: ignore[attr-defined]
    with pytest.raises(InvalidJobArguments, match="busy_s"):
        validate_kwargs(probe, {"busy_s": -1})
    with pytest.raises(InvalidJobArguments, match="'bogus'"):
        validate_kwargs(probe, {"bogus": 1})
    with pytest.raises(InvalidJobArguments, match="must be a JSON object"):
        validate_kwargs(probe, ["not", "a", "dict"])


def test_importing_the_package_does_not_import_torch():
    # A worker must set CUDA_VISIBLE_DEVICES before torch loads; `import tasks` must not load it.
    import subprocess
    import sys

    code = "import sys, tasks, tasks.cli; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_kwargs_that_are_not_a_mapping_are_named_in_the_error():
    """fan_out("probe", kwargs="epochs=3") names the argument, not dict()'s ValueError."""
    with pytest.raises(ConfigError, match=r"kwargs='epochs=3' is not a mapping.*kwargs=\{'epochs': 3\}"):
        JobSpec.of("probe", "epochs=3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"kwargs='epochs=3': Input should be a valid dictionary"):
        JobSpec.of(("probe", "epochs=3"))  # type: ignore[arg-type]


# -- the job process's pipe and what the worker makes of it -------------------------------------


def test_the_pipe_carries_typed_json_messages_and_refuses_anything_else():
    from pydantic import ValidationError

    from tasks.core.records import ErrorInfo
    from tasks.core.wire import Finished, Outcome, StopJob, StopReason, decode_from_job_process, decode_from_worker

    stop = StopJob(job_id="j1", reason=StopReason.TIMEOUT, message="past its time limit")
    assert decode_from_worker(stop.encode()) == stop
    done = Finished(outcome=Outcome.ERROR, error=ErrorInfo(type="ValueError", message="boom"), rss_bytes=1)
    assert decode_from_job_process(done.encode()) == done
    # JSON only (a pickle is not JSON), known kinds only, no unknown fields, and each direction
    # takes only its own kinds: a job process cannot send the worker a job to run.
    for data in (b"\x80\x04K\x01.", b'{"kind": "exec", "argv": ["sh"]}',
                 b'{"kind": "done", "outcome": "ok", "rss_bytes": 1, "extra": 1}'):
        with pytest.raises(ValidationError):
            decode_from_job_process(data)
    with pytest.raises(ValidationError):
        decode_from_job_process(b'{"kind": "run", "job_id": "x", "job": "noop", "kwargs": {}, "fan_out_id": "x"}')


def test_a_job_process_error_becomes_an_exception_of_the_type_it_named():
    from tasks.core.errors import JobCrashed, OutOfMemory
    from tasks.core.records import ErrorInfo
    from tasks.worker.disposition import exception_of

    crashed = exception_of(ErrorInfo(type="JobCrashed", message="killed by SIGSEGV"), "tasks.core.errors")
    assert type(crashed) is JobCrashed and str(crashed) == "killed by SIGSEGV"
    oom = exception_of(ErrorInfo(type="OutOfMemory", message="out", memory={"device": "cuda:0"}), None)
    assert isinstance(oom, OutOfMemory) and oom.memory == {"device": "cuda:0"}
    assert type(exception_of(ErrorInfo(type="ValueError", message="boom"), "builtins")) is ValueError
    # A job's own exception type: a class of that name and module, as Celery makes for one it
    # cannot import; a builtin whose constructor takes more than a message, likewise.
    own = exception_of(ErrorInfo(type="DataLoaderStalled", message="stalled"), "my_jobs")
    assert (type(own).__name__, type(own).__module__, str(own)) == ("DataLoaderStalled", "my_jobs", "stalled")
    odd = exception_of(ErrorInfo(type="UnicodeDecodeError", message="bad byte"), "builtins")
    assert type(odd).__name__ == "UnicodeDecodeError" and str(odd) == "bad byte"
    # A devicefleet error that is not a job error is not built as ours: the job process names a
    # type for the stored failure, it does not pick one of the worker's classes.
    assert type(exception_of(ErrorInfo(type="ConfigError", message="x"), "tasks.core.errors")).__name__ == "ConfigError"
    assert not isinstance(exception_of(ErrorInfo(type="ConfigError", message="x"), None), ValueError)


def test_cuda_errors_that_poison_a_context_are_told_from_a_jobs_own():
    from tasks.jobproc.runtime import poisons_cuda

    assert poisons_cuda(RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors ..."))
    assert poisons_cuda(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert poisons_cuda(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"))
    assert not poisons_cuda(ValueError("boom"))
    assert not poisons_cuda(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"))


def test_a_job_process_gets_the_workers_environment_less_every_key_to_the_fleet():
    import os

    from tasks.worker.jobenv import fleet_secrets, job_environment

    url = "redis://:s3cret-pass@10.0.0.5:6379/0"
    base = {"PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "2",
            "CUDA_HOME": "/usr/local/cuda", "WANDB_API_KEY": "the-users-own", "PYTHONPATH": "/src",
            "DEVICEFLEET_REDIS_URL": url, "DEVICEFLEET_CORES": "0", "CELERY_BROKER_URL": url,
            "COPY_OF_THE_URL": f"see {url}", "REDISCLI_AUTH": "s3cret-pass"}
    env = job_environment(Device.parse("cpu0"), 4, fleet_secrets(url), base=base)
    kept = ("PATH", "HOME", "LANG", "OMP_NUM_THREADS", "CUDA_HOME", "WANDB_API_KEY")
    assert {name: env[name] for name in kept} == {name: base[name] for name in kept}
    assert not [name for name in env if name.startswith(("DEVICEFLEET_", "CELERY_"))]
    assert "COPY_OF_THE_URL" not in env and "REDISCLI_AUTH" not in env
    assert not [name for name, value in env.items() if "s3cret-pass" in value]
    assert env["CUDA_VISIBLE_DEVICES"] == "-1" and env["PYTHONUNBUFFERED"] == "1"
    assert "/src" in env["PYTHONPATH"].split(os.pathsep)


def test_the_fleets_secrets_are_its_url_and_every_password_in_it():
    from tasks.worker.jobenv import fleet_secrets

    sentinel = "sentinel://:redis-pw@h1:26379,h2:26379/0?master_name=m&sentinel_password=sentinel-pw"
    assert set(fleet_secrets(sentinel)) == {sentinel, "redis-pw", "sentinel-pw"}
    assert set(fleet_secrets("redis://:p%40ss-word@h:6379/0")) == {"redis://:p%40ss-word@h:6379/0", "p%40ss-word",
                                                                   "p@ss-word"}
    assert fleet_secrets("redis://127.0.0.1:6379/0") == ["redis://127.0.0.1:6379/0"]
    assert fleet_secrets(None) == []
