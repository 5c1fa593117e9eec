"""Worker configs: one TOML file per worker in ``worker_configs/``.

``cpu.toml`` configures every CPU worker and ``gpu.toml`` is the template instantiated per GPU
index; a file named after one worker (``gpu1.toml``) overrides the template for that worker.
The local launcher and the systemd units read the same files.
"""

from __future__ import annotations

import tomllib
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .commands import CommandPolicy
from .defaults import (
    CANCEL_GRACE_S,
    KEPT_USER_PROCESSES,
    LOADER_CORES,
    MAX_JOB_SECONDS,
    MAX_MEMORY_GROWTH_MIB,
    MAX_SLOTS,
    PREEMPT_GRACE_S,
    PREEMPT_MIN_RUN_S,
)
from .devices import Device, DeviceKind, parse_core_list
from .errors import ConfigError
from .placement import LabelValue
from .validation import describe_validation_error


class Pool(str, Enum):
    """Celery pools; a device worker runs ``threads`` or ``solo`` (``prefork`` is refused, by name)."""

    THREADS = "threads"
    SOLO = "solo"
    PREFORK = "prefork"


class WorkerConfig(BaseModel):
    """One worker's settings, as its TOML file gives them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: DeviceKind
    pool: Pool = Pool.THREADS
    #: Jobs the device runs at once, each in a job process of its own (a *slot*) with its share
    #: of the cores and its memory budget (``memory_gib``). ``concurrency``, the old name, is
    #: read as this.
    slots: int = Field(default=1, ge=1, le=MAX_SLOTS)
    #: Each slot's memory budget in GiB: device memory on a GPU (measured per process with NVML;
    #: the job's CUDA allocator is capped below it), resident memory of the job's processes on a
    #: CPU device. A job past it ends as ``OutOfMemory``. Default: the device's memory (the GPU's,
    #: or the host's RAM) split ``slots`` ways.
    memory_gib: float | None = Field(default=None, gt=0, le=65536)
    #: Run the device's job processes as clients of a CUDA MPS server the worker starts (GPU
    #: workers, with ``nvidia-cuda-mps-control`` on PATH): their kernels run at once instead of
    #: taking turns, but a fatal GPU error in one client ends every client on the device.
    mps: bool = False
    #: ``"auto"`` (a share of the host's cores, see ``devices.plan_cores``) or a CPU list.
    cores: str = "auto"
    #: Cores a GPU worker keeps for its data loading when cores are ``auto``.
    loader_cores: int = Field(default=LOADER_CORES, ge=1, le=256)
    #: ``torch.set_num_threads``; ``"auto"`` is the number of cores the worker owns.
    torch_threads: int | Literal["auto"] = "auto"
    #: Extra queues to consume besides ``<kind>``, ``device.<name>`` and ``fleet``.
    extra_queues: list[str] = Field(default_factory=list)
    #: Celery log level of the worker.
    loglevel: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: Longest job this worker is expected to run: a job's time limit unless the job sets its
    #: own (``time_limit_s``); systemd's stop timeout is derived from it.
    max_job_seconds: int = Field(default=MAX_JOB_SECONDS, ge=1)
    #: How long a running job may go on once the worker is asked to stop; then its process is
    #: ended and its entry stored (``WorkerStopped``). Default: ``max_job_seconds``.
    stop_timeout_s: int | None = Field(default=None, ge=1)
    #: Seconds a job asked to stop has to stop at ``ctx.progress()``; then its process group is
    #: ended (SIGTERM, then SIGKILL).
    cancel_grace_s: float = Field(default=CANCEL_GRACE_S, gt=0, le=3600)
    #: Seconds a preempted job (higher-level work waits for the device) has to checkpoint and
    #: stop at ``ctx.progress()`` (a command: after its SIGTERM); then its process group is ended.
    preempt_grace_s: float = Field(default=PREEMPT_GRACE_S, gt=0, le=3600)
    #: Seconds a job runs before it may be preempted.
    preempt_min_run_s: float = Field(default=PREEMPT_MIN_RUN_S, ge=0, le=86_400)
    #: Jobs one job process runs before it is replaced by a fresh one; 0: no limit (it is
    #: replaced anyway after a crash, a kill, a CUDA error or past the memory threshold).
    jobs_per_process: int = Field(default=0, ge=0)
    #: Replace a job process whose resident memory grew by more than this (MiB) since it was
    #: ready; 0: never.
    max_memory_growth_mib: int = Field(default=MAX_MEMORY_GROWTH_MIB, ge=0)
    #: NVML's index of the GPU whose health this worker watches (:mod:`tasks.worker.health`). A
    #: GPU worker watches its own GPU without it; a CPU worker watches none unless it names one
    #: (on a host with a GPU and ``nvidia-ml-py``: how the tests drive it with a fake NVML).
    health_nvml_index: int | None = Field(default=None, ge=0)
    #: Idle job processes of other users kept warm beyond the slots and spares (a process runs
    #: one user's jobs only); 0: another user's job retires the least recently used one.
    kept_user_processes: int = Field(default=KEPT_USER_PROCESSES, ge=0, le=MAX_SLOTS)
    #: The ``[commands]`` table: the programs and folders commands may use on this device
    #: (``devicefleet run -- CMD``); empty: the device runs no commands.
    commands: CommandPolicy = Field(default_factory=CommandPolicy)
    #: What the device is, beyond what the worker detects (``labels = {nvlink = true, rack = "a"}``):
    #: JSON scalars that jobs' placement constraints match (``--require label.nvlink=true``).
    labels: dict[str, LabelValue] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """``concurrency`` (the old name of ``slots``) is read as ``slots``."""
        if isinstance(data, dict) and "concurrency" in data:
            data = dict(data)
            concurrency = data.pop("concurrency")
            if "slots" in data and data["slots"] != concurrency:
                raise ValueError(f"concurrency={concurrency!r} and slots={data['slots']!r}: concurrency is "
                                 "the old name of slots; keep slots only")
            data["slots"] = concurrency
        return data

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        if self.pool is Pool.PREFORK:
            why = ("it forks after CUDA is initialised" if self.kind is DeviceKind.GPU else
                   "its child processes would run jobs without the worker's lease and heartbeat threads")
            raise ValueError(f"pool='prefork' is not supported: {why}; use 'threads' or 'solo'")
        if self.cores != "auto":
            parse_core_list(self.cores)
        if self.mps and self.kind is not DeviceKind.GPU:
            raise ValueError("mps = true is for GPU workers: CUDA MPS shares a GPU between processes")
        return self


def config_file(directory: Path, device: Device) -> Path:
    """The file that configures ``device``: its own, else its kind's template."""
    own = directory / f"{device.base}.toml"
    return own if own.is_file() else directory / f"{device.kind.value}.toml"


def load_worker_config(directory: Path, device: Device) -> WorkerConfig:
    """Read and validate the config of ``device`` from ``directory``.

    Raises:
        ConfigError: the file is missing or invalid; the message names the file and the value.
    """
    path = config_file(directory, device)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"no worker config for {device}: {path} does not exist "
            f"(expected {device.kind.value}.toml or {device.base}.toml in {directory})"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        config = WorkerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {describe_validation_error(exc)}") from None
    if config.kind is not device.kind:
        raise ConfigError(f"{path}: kind={config.kind.value!r} but it configures {device}")
    return config
