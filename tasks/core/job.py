"""Jobs: named functions a worker runs, with JSON kwargs checked against a schema.

A module defines jobs with :func:`job`; a worker runs only the jobs of the modules on its
allowlist (:class:`tasks.jobproc.registry.JobRegistry`), each as the Celery task ``devicefleet.<name>``.
A message only names a job, so it can never make a worker import other code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from .errors import ConfigError, DeviceFleetError, JobCancelled, UnknownJob

logger = logging.getLogger(__name__)

P = TypeVar("P", bound=BaseModel)
JobFunc = Callable[["JobContext", Any], dict[str, Any]]

#: The Celery state of a running job that reported progress (its fields are the state's meta),
#: and the task event that carries the same fields to Flower.
PROGRESS_STATE = "PROGRESS"
PROGRESS_EVENT = "task-progress"

#: Celery task names of jobs: ``devicefleet.train`` for the job ``train``.
TASK_PREFIX = "devicefleet."


#: The chord body of a fan-out: folds the entries into ``{device: entry}`` (no job may be
#: called ``collect``).
COLLECT_TASK = f"{TASK_PREFIX}collect"


def unknown_job(name: str, names: list[str], modules: list[str]) -> UnknownJob:
    """The error for a job ``name`` that a worker whose allowlist (``modules``) defines only
    ``names`` does not run (a message naming another task)."""
    return UnknownJob(
        f"unknown job {name!r}: this worker runs only {', '.join(names) or 'no jobs'} "
        f"(from the allowlisted modules {', '.join(modules) or 'none'}); add the module "
        "that defines it to DEVICEFLEET_JOB_MODULES on the workers"
    )


def task_name(job: str) -> str:
    """The Celery task that runs ``job``: ``train`` -> ``devicefleet.train``."""
    return f"{TASK_PREFIX}{job}"


class JobMetric(str, Enum):
    """Fleet metrics a job's output can feed (``devicefleet status``, the Prometheus exporter).

    A job says which of its output fields are which with ``@job(..., metrics={field: metric})``.
    """

    #: Counter: samples processed (``devicefleet_train_samples_total``).
    SAMPLES = "samples"
    #: Gauge, the last job's value: training samples per second.
    SAMPLES_PER_S = "samples_per_s"
    #: Gauge, the last job's value: fraction of the job spent waiting for data.
    DATA_WAIT_FRACTION = "data_wait_fraction"

    @property
    def is_counter(self) -> bool:
        return self is JobMetric.SAMPLES


@dataclass(frozen=True)
class DistributedInfo:
    """Where a rank of a distributed job stands (``ctx.distributed``); the process group is
    ``torch.distributed``'s default group, initialised before the job starts and destroyed
    after it ends (the worker owns it: a job never calls ``init_process_group``)."""

    rank: int
    world_size: int
    #: The rank's index among the gang's ranks on the same host, as torchrun numbers them.
    #: Each worker sees only its own GPU: use ``ctx.torch_device``, not ``cuda:<local_rank>``.
    local_rank: int
    #: ``gloo`` or ``nccl``.
    backend: str
    #: How many times the gang has restarted (0 on the first run).
    restarts: int
    #: Rank 0's TCP store, which every rank joined: ``MASTER_ADDR`` and ``MASTER_PORT``.
    master_addr: str
    master_port: int


@dataclass
class JobContext:
    """What a running job knows about where it runs."""

    #: Device name, e.g. ``cpu0``.
    device: str
    #: ``cpu`` or ``cuda:0``: what to pass to ``torch.device``.
    torch_device: str
    #: This run's id (the Celery task id).
    job_id: str
    #: A folder only this run writes to, for checkpoints and other files.
    artifacts_dir: Path
    #: Cores this run may use (its slot's share of the worker's cores).
    cores: list[int] = field(default_factory=list)
    #: torch's intra-op threads for this run (``torch.get_num_threads()``); 0: not set.
    threads: int = 0
    #: The device's slot that runs it (0 on a device with one slot).
    slot: int = 0
    #: Called with progress fields (``step``, ``total``, ``loss``...); a no-op by default.
    reporter: Callable[[dict[str, Any]], None] | None = None
    #: The torch device this run fell back from after running out of memory (else None).
    fallback_from: str | None = None
    #: Called by :meth:`log` with ``(step, scalars)``; the worker buffers them for TensorBoard.
    scalar_sink: Callable[[int, dict[str, Any]], None] | None = None
    #: True once the producer cancelled this run (``handle.cancel()``, a pruned trial), or
    #: the worker asked it to stop (its time limit, the worker's stop).
    cancelled: Callable[[], bool] | None = None
    #: The error :meth:`progress` raises once ``cancelled`` is true (default: JobCancelled).
    interruption: Callable[[], DeviceFleetError] | None = None
    #: Set when this run is one rank of a distributed job (``fan_out(..., distributed=True)``).
    distributed: DistributedInfo | None = None
    #: Every device this run may use: ``[device]``, or a device group's devices
    #: (``fan_out(..., group=2)``: ``["cpu0", "cpu1"]``), whose cores are all in ``cores``
    #: and whose GPUs are all visible (``cuda:0`` .. ``cuda:<k-1>``, in PCI bus order).
    devices: list[str] = field(default_factory=list)
    #: True once the worker asked this run to make way for higher-level work (see :meth:`preempted`).
    preemption: Callable[[], bool] | None = None
    #: Which run of the job this is: 1 first, one more after each preemption or lost worker
    #: (the same ``job_id`` and ``artifacts_dir`` each time: resume from a checkpoint there).
    attempt: int = 1
    #: The most memory this run may take on its device, in bytes: on a GPU, CUDA's allocator cap
    #: for the job (its slot's budget less what the process held before it); None: no cap known.
    #: :func:`tasks.place_data` decides from it whether a dataset can live on the device.
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = [self.device]

    @property
    def rank(self) -> int:
        """This run's rank: 0 unless it is a rank of a distributed job."""
        return self.distributed.rank if self.distributed is not None else 0

    @property
    def world_size(self) -> int:
        """How many ranks the job has: 1 unless it is distributed."""
        return self.distributed.world_size if self.distributed is not None else 1

    @property
    def local_rank(self) -> int:
        return self.distributed.local_rank if self.distributed is not None else 0

    @property
    def process_group(self) -> Any:
        """The job's ``torch.distributed`` process group (the default group), or None."""
        if self.distributed is None:
            return None
        import torch.distributed as dist

        return dist.group.WORLD

    def preempted(self) -> bool:
        """Whether higher-level work waits for this device and the worker asked this run to make
        way: checkpoint now. Its next :meth:`progress` raises
        :class:`~tasks.core.errors.Preempted`; the job then goes back to its queue and runs again
        (``attempt`` one more), so save what it needs to resume in ``artifacts_dir``. Cheap: one
        attribute read."""
        return self.preemption is not None and self.preemption()

    def progress(self, **fields: Any) -> None:
        """Report progress, e.g. ``ctx.progress(epoch=3, epochs=15, loss=0.21)``.

        Cheap enough to call every step: the worker publishes a few reports a second and always
        the last one. ``step`` with ``value`` is an intermediate value of a sweep's trial, which
        ``tasks.optimize`` hands to Optuna's pruner.

        Raises:
            JobCancelled: the run was cancelled or its trial pruned; let it propagate (the
                job's ``finally`` blocks run) and the device takes its next job.
            JobTimeout: the run is past its time limit (likewise).
            Preempted: higher-level work takes the device (likewise); the job runs again later.
        """
        if self.cancelled is not None and self.cancelled():
            if self.interruption is not None:
                raise self.interruption()
            raise JobCancelled(f"job {self.job_id} on {self.device} was cancelled; it stopped at ctx.progress()")
        if self.reporter is not None:
            self.reporter(fields)

    def log(self, step: int, **scalars: float) -> None:
        """Log numbers at ``step`` for TensorBoard, e.g. ``ctx.log(epoch, loss=0.21)``.

        Buffered in memory and written by a background thread, so it is cheap enough to call
        every step. The curves land under ``<artifacts>/tensorboard/<job>-<fan-out>/<device>``.
        """
        if self.scalar_sink is not None:
            self.scalar_sink(step, scalars)


@dataclass(frozen=True)
class PackData:
    """One trial's data for a packed run: CPU tensors, ``x_*`` samples x features, ``y_*``
    integer class labels. Every member of a pack must have the same number of training samples
    (the pack key's params make sure of it); each may have its own split (its own seed)."""

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    #: What else the job's model builder needs to know of the data (``{"classes": 10}``).
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Packing:
    """A job's opt-in to packed trials (``tasks.sweep(..., pack=K)``): K trials of the job whose
    ``key`` params are equal train in one job process as one vmapped model
    (:mod:`tasks.jobproc.packed`). The job's own function still runs every trial that is not packed.

    Per member the trainer reads ``seed`` (model init and batch order), ``lr``,
    ``weight_decay`` (Adam's; 0 if the params have none), ``epochs`` and ``batch_size`` from its
    params, so they must be fields of the job's params (``epochs`` and ``batch_size`` in ``key``).
    """

    #: The names of the params that must be equal for trials to share a pack: everything that
    #: decides the model's shapes, the data's size and the number of steps.
    key: tuple[str, ...]
    #: ``model(params, data) -> torch.nn.Module``: a fresh model; called after
    #: ``torch.manual_seed(params.seed)``, so its initial weights follow the member's seed.
    model: Callable[[Any, PackData], Any]
    #: ``data(params) -> PackData``: the member's data, on the CPU (the trainer moves it to the device).
    data: Callable[[Any], PackData]
    #: ``loss(outputs, labels) -> scalar tensor``: the mean loss on one batch; None: cross-entropy.
    loss: Callable[[Any, Any], Any] | None = None
    #: ``output(params, data) -> dict``: fields of the member's result beside what the trainer
    #: gives (``accuracy``, ``loss``, ``history``, ``checkpoint``...); None: none.
    output: Callable[[Any, PackData], dict[str, Any]] | None = None
    #: ``checkpoint(ctx, params, model, optimizer, epoch)``: save what the job's own function
    #: resumes from (a member's model and a ``torch.optim.Adam`` holding its moments), called
    #: after an epoch when the params' ``checkpoint_every_s`` has passed or the member is asked
    #: to make way; a member that runs again unpacked then resumes. None: packed members save none.
    checkpoint: Callable[[JobContext, Any, Any, Any, int], None] | None = None

    def key_of(self, params: BaseModel) -> tuple[Any, ...]:
        """The values that must be equal for two trials to share a pack."""
        return tuple(json_key(getattr(params, name)) for name in self.key)


def json_key(value: Any) -> Any:
    """``value`` as it compares in a pack key (an enum by its value)."""
    return value.value if isinstance(value, Enum) else value


@dataclass(frozen=True)
class JobDefinition:
    """A job as :func:`job` declared it."""

    name: str
    func: JobFunc
    params: type[BaseModel]
    module: str
    #: ``{output field: metric}``: the output fields the fleet counts (see :class:`JobMetric`).
    metrics: Mapping[str, JobMetric] = field(default_factory=dict)
    #: How its trials pack (:class:`Packing`); None: the job does not pack.
    pack: Packing | None = None

    @property
    def task_name(self) -> str:
        return task_name(self.name)

    def metric_values(self, output: Mapping[str, Any] | None) -> dict[JobMetric, float]:
        """The declared metrics found in ``output`` (numbers only)."""
        values: dict[JobMetric, float] = {}
        for key, metric in self.metrics.items():
            value = (output or {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[metric] = float(value)
        return values


#: Every job defined by an imported module, by name; a worker keeps those of its allowlist.
DEFINED: dict[str, JobDefinition] = {}


def job(name: str, *, params: type[P], metrics: Mapping[str, JobMetric] | None = None,
        pack: Packing | None = None) -> Callable[[Callable[[JobContext, P], dict[str, Any]]], Callable[[JobContext, P], dict[str, Any]]]:
    """Declare a job called ``name`` whose kwargs validate against ``params``.

    The function takes ``(ctx: JobContext, params: P)`` and returns a JSON-able dict.
    ``metrics`` maps output fields to the fleet metrics they feed. ``pack`` opts the job in
    to packed trials (:class:`Packing`; ``docs/guides/packing.md``).

    Raises:
        ConfigError: ``pack`` names a param the job's params do not have.
    """
    if pack is not None:
        missing = [name for name in pack.key if name not in params.model_fields]
        if missing:
            raise ConfigError(f"job {name!r}: pack key names {', '.join(missing)}, which "
                              f"{params.__name__} does not have; name fields of the job's params")

    def register(func: Callable[[JobContext, P], dict[str, Any]]) -> Callable[[JobContext, P], dict[str, Any]]:
        DEFINED[name] = JobDefinition(name=name, func=func, params=params, module=func.__module__,
                                      metrics=dict(metrics or {}), pack=pack)
        return func

    return register
