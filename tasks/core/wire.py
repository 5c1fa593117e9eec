"""The pipe between a device worker and its job processes: typed messages, JSON on the wire.

A device worker (:mod:`tasks.worker.supervisor`) runs every job in a child *job process*
(:mod:`tasks.jobproc`) and talks to it over one socket pair, one message per frame:

- worker -> job process: :class:`ProcessSpec` (first, once: what the process is for),
  :class:`RunJob` (one job), :class:`StopJob` (ask the running job to stop at its next
  ``ctx.progress()``);
- job process -> worker: :class:`Hello` (ready: the jobs it loaded, what torch sees) or
  :class:`Refused` (it cannot run jobs: a job module does not import, the device is not
  visible), :class:`Report` (a job's throttled progress), :class:`Finished` (a job's outcome).

JSON, not pickle, in both directions: the job process runs untrusted code, and nothing it writes
to the pipe may become an object in the worker other than these records.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter

from .commands import CommandRules
from .defaults import CANCEL_GRACE_S
from .records import ErrorInfo


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


class StopReason(str, Enum):
    """Why the worker stops a running job."""

    #: The producer cancelled it (``handle.cancel()``, Ctrl-C on ``devicefleet run``, a pruned trial).
    CANCEL = "cancel"
    #: It ran past its time limit.
    TIMEOUT = "timeout"
    #: The worker is stopping.
    SHUTDOWN = "shutdown"


class ProcessSpec(_Message):
    """What a job process is for; sent once, first (not in argv: the Redis URL may hold a password)."""

    kind: Literal["spec"] = "spec"
    device: str
    #: ``cpu`` or ``cuda:0``.
    torch_device: str
    #: Cores the process is pinned to.
    cores: list[int]
    torch_threads: int
    #: The allowlist: modules whose jobs the process imports before it says hello.
    job_modules: list[str]
    #: The fleet's Redis (distributed jobs meet there); None outside a fleet.
    redis_url: str | None = None
    artifacts_dir: str
    tensorboard_dir: str
    result_expires_s: int
    #: Where a distributed job's rank 0 is reached by the other ranks.
    address: str = "127.0.0.1"
    #: The programs and folders commands may use (the worker config's ``[commands]``,
    #: resolved); None: this device runs no commands.
    commands: CommandRules | None = None
    #: Seconds a job asked to stop has before the worker ends its process group.
    cancel_grace_s: float = CANCEL_GRACE_S


class JobInfo(BaseModel):
    """A job the process loaded from the allowlist."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    module: str
    doc: str | None = None


class Hello(_Message):
    """The job process is ready: its jobs are imported and torch sees the device."""

    kind: Literal["hello"] = "hello"
    pid: int
    jobs: list[JobInfo]
    #: :func:`tasks.core.devices.visibility` of the process.
    visibility: dict[str, JsonValue]
    #: Resident memory once ready: the baseline the worker's memory threshold counts from.
    rss_bytes: int


class Refused(_Message):
    """The job process cannot run jobs; ``config`` when a setting is at fault (exit status 2)."""

    kind: Literal["refused"] = "refused"
    error: ErrorInfo
    config: bool = False


class RunJob(_Message):
    """Run one job."""

    kind: Literal["run"] = "run"
    job_id: str
    job: str
    kwargs: JsonValue
    #: :class:`tasks.core.records.JobOptions`, as a dict.
    options: dict[str, JsonValue] = Field(default_factory=dict)
    #: The fan-out the job belongs to (its TensorBoard run's folder).
    fan_out_id: str
    #: The device's slot that runs it, with that slot's cores and torch threads (the process
    #: pins itself to them for this job); None: the process's own (:class:`ProcessSpec`).
    slot: int | None = None
    cores: list[int] | None = None
    torch_threads: int | None = None
    #: The most CUDA's caching allocator may hold for this job
    #: (``torch.cuda.set_per_process_memory_fraction``): the slot's budget less what the process
    #: held before the job. None: no cap.
    allocator_limit_bytes: int | None = Field(default=None, ge=0)


class StopJob(_Message):
    """Stop the running job ``job_id`` at its next ``ctx.progress()``, which raises the error
    of ``reason`` (JobCancelled, JobTimeout, WorkerStopped) with ``message``."""

    kind: Literal["stop"] = "stop"
    job_id: str
    reason: StopReason
    message: str


class Report(_Message):
    """A running job's progress (already throttled by the job process)."""

    kind: Literal["progress"] = "progress"
    fields: dict[str, JsonValue]


class Outcome(str, Enum):
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    #: A rank gives its device to an older gang (``tasks.jobproc.distributed.GiveWay``): the
    #: worker sends its message back to the queue.
    GIVE_WAY = "give_way"


class Finished(_Message):
    """A job's end, as its process saw it."""

    kind: Literal["done"] = "done"
    outcome: Outcome
    output: dict[str, JsonValue] | None = None
    error: ErrorInfo | None = None
    #: The module of the job's exception type (so the stored failure names it as Celery would).
    error_module: str | None = None
    #: The job's declared metrics found in its output (``JobMetric`` value -> number).
    metrics: dict[str, float] = Field(default_factory=dict)
    #: Bytes CUDA's caching allocator holds after the job; None without CUDA.
    gpu_memory_bytes: int | None = None
    #: Resident memory of the process after the job.
    rss_bytes: int
    #: Why this process must not run another job (device memory still held after an
    #: out-of-memory, a CUDA error that may have poisoned its context); None: it may.
    retire: str | None = None


FromWorker = Annotated[ProcessSpec | RunJob | StopJob, Field(discriminator="kind")]
FromJobProcess = Annotated[Hello | Refused | Report | Finished, Field(discriminator="kind")]

_FROM_WORKER: TypeAdapter[Any] = TypeAdapter(FromWorker)
_FROM_JOB_PROCESS: TypeAdapter[Any] = TypeAdapter(FromJobProcess)


def decode_from_worker(data: bytes) -> ProcessSpec | RunJob | StopJob:
    """A message the worker sent. Raises pydantic's ``ValidationError`` if it is not one."""
    message: ProcessSpec | RunJob | StopJob = _FROM_WORKER.validate_json(data)
    return message


def decode_from_job_process(data: bytes) -> Hello | Refused | Report | Finished:
    """A message a job process sent. Raises pydantic's ``ValidationError`` if it is not one."""
    message: Hello | Refused | Report | Finished = _FROM_JOB_PROCESS.validate_json(data)
    return message
