"""The pipe between a device worker and its job processes: typed messages, JSON on the wire.

A device worker (:mod:`tasks.worker.supervisor`) runs every job in a child *job process*
(:mod:`tasks.jobproc`) and talks to it over one socket pair, one message per frame:

- worker -> job process: :class:`ProcessSpec` (first, once: what the process is for),
  :class:`RunJob` (one job; for a rank of a distributed job with its :class:`Rank`),
  :class:`RunPack` (K trials of one job trained as one packed model, one :class:`Finished` each),
  :class:`StopJob` (ask the running job to stop at its next ``ctx.progress()``),
  :class:`Proceed` (the answer to a :class:`RankFailed`);
- job process -> worker: :class:`Hello` (ready: the jobs it loaded, what torch sees) or
  :class:`Refused` (it cannot run jobs: a job module does not import, the device is not
  visible), :class:`Report` (a job's throttled progress), :class:`LogLines` (a batch of a
  command's output lines), :class:`StoreOpened` (rank 0's ``TCPStore`` listens),
  :class:`RankFailed` (a rank's own error, before its process group goes), :class:`Finished`
  (a job's outcome).

JSON, not pickle, in both directions: the job process runs untrusted code, and nothing it writes
to the pipe may become an object in the worker other than these records. The job process holds
no key to the fleet: no Redis URL or password travels here, and what a job sends out (progress,
log lines, a gang's store) the worker relays.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter

from .commands import CommandRules
from .defaults import CANCEL_GRACE_S
from .errors import DeviceFailed, DeviceFleetError, JobCancelled, JobTimeout, PeerLost, Preempted, WorkerStopped
from .priority import Level
from .records import ErrorInfo, Visibility


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
    #: A rank's gang failed or moved to another generation while it ran (a peer died).
    GANG = "gang"
    #: Self-fencing: its worker could not renew its lease (cut off from Redis) for long enough
    #: that the lease may soon go to another worker, or found it gone to a newer attempt.
    FENCED = "fenced"
    #: Work of a higher level waits for the device (:mod:`tasks.worker.preemption`): the job goes
    #: back to its queue and runs again.
    PREEMPT = "preempt"
    #: Its device failed under it (a fatal Xid or ECC event: :mod:`tasks.worker.health`): a job
    #: from a shared queue goes back to it, one sent to the device by name ends ``DeviceFailed``.
    DEVICE_FAILED = "device_failed"


class ProcessSpec(_Message):
    """What a job process is for; sent once, first. Nothing in it opens the fleet's Redis."""

    kind: Literal["spec"] = "spec"
    device: str
    #: ``cpu`` or ``cuda:0``.
    torch_device: str
    #: Cores the process is pinned to.
    cores: list[int]
    torch_threads: int
    #: The allowlist: modules whose jobs the process imports before it says hello.
    job_modules: list[str]
    artifacts_dir: str
    tensorboard_dir: str
    result_expires_s: int
    #: The programs and folders commands may use (the worker config's ``[commands]``,
    #: resolved); None: this device runs no commands.
    commands: CommandRules | None = None
    #: Seconds a job asked to stop has before the worker ends its process group.
    cancel_grace_s: float = CANCEL_GRACE_S
    #: The system account it runs as, one user's (:mod:`tasks.core.accounts`); None: the worker's.
    #: It then checks first that it holds no capability, and refuses to start if it does.
    account: str | None = None


class JobInfo(BaseModel):
    """A job the process loaded from the allowlist."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    module: str
    doc: str | None = None
    #: The names of the job's params that must be equal for trials to share a pack (their
    #: models' shapes: :class:`tasks.core.job.Packing`); None: the job does not pack.
    pack: list[str] | None = None
    #: The JSON schema of the job's params (``model_json_schema()``): the worker publishes it
    #: (:func:`tasks.core.keys.job_schemas`) so producers refuse bad kwargs before sending
    #: (:mod:`tasks.core.arguments`); None: the model has no JSON schema (nothing is checked).
    params_schema: dict[str, Any] | None = None


class DeviceView(BaseModel):
    """What a job process sees of its device (:func:`tasks.core.devices.visibility`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cuda_visible_devices: str | None = None
    cuda_available: bool | None = None
    cuda_device_count: int | None = None
    device_name: str | None = None
    #: Bytes of device memory (a GPU's); None on a CPU.
    total_memory: int | None = None
    #: How NVML finds the same GPU: ``GPU-<uuid>``; None on a CPU.
    uuid: str | None = None
    #: The GPU's CUDA compute capability, ``"9.0"``; None on a CPU.
    compute_capability: str | None = None
    torch_version: str | None = None
    torch_threads: int | None = None

    @property
    def entry(self) -> Visibility:
        """What entries report of it."""
        return Visibility(cuda_visible_devices=self.cuda_visible_devices, cuda_available=self.cuda_available,
                          device_name=self.device_name)


class Hello(_Message):
    """The job process is ready: its jobs are imported and torch sees the device."""

    kind: Literal["hello"] = "hello"
    pid: int
    jobs: list[JobInfo]
    #: What the process sees of its device.
    visibility: DeviceView
    #: Resident memory once ready: the baseline the worker's memory threshold counts from.
    rss_bytes: int


class Refused(_Message):
    """The job process cannot run jobs; ``config`` when a setting is at fault (exit status 2)."""

    kind: Literal["refused"] = "refused"
    error: ErrorInfo
    config: bool = False


class Rank(BaseModel):
    """One rank of a distributed job, as the worker's gang (:mod:`tasks.worker.gang`) assembled
    it: the job process runs ``init_process_group`` with it, and the user's code."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gang_id: str
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    #: The rank's index among the gang's ranks on its host, as torchrun numbers them.
    local_rank: int = Field(ge=0)
    #: The gang's generation: how many times it has restarted.
    generation: int = Field(ge=0)
    max_restarts: int = Field(ge=0)
    backend: Literal["gloo", "nccl"]
    collective_timeout_s: float = Field(gt=0)
    #: Rank 0's TCP store. Rank 0 gets its own address and no port: it opens the store on a
    #: port the OS picks and says which (:class:`StoreOpened`).
    master_addr: str
    master_port: int | None = None


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
    #: Set on a rank of a distributed job.
    rank: Rank | None = None
    #: A device group's devices (``ctx.devices``), its leader's first; its ``cores`` and
    #: ``torch_threads`` are then the union of theirs. None: the process's own device.
    devices: list[str] | None = None
    #: Which run of the job this is (1 first; each preemption or lost worker adds one): a
    #: command finds it in ``DEVICEFLEET_ATTEMPT``, a job in ``ctx.attempt``.
    attempt: int = Field(default=1, ge=1)


class RunPack(_Message):
    """Run K trials of one job as one packed (vmapped) model: each member is a full
    :class:`RunJob` (its own job id, kwargs, options, fan-out, attempt); the FIRST member's
    slot, cores, torch threads and allocator limit apply to the whole pack. The job process
    sends one :class:`Finished` per member (``job_id`` set), each as soon as that member ends;
    the pack is over when every member has its Finished. A member that does not fit the slot's
    budget comes back as ``Finished(outcome=GIVE_WAY, error=PackTooLarge ...)``: the worker
    sends its message back to its queue."""

    kind: Literal["pack"] = "pack"
    members: list[RunJob] = Field(min_length=1)
    #: Whether a place a member frees may be refilled: the job process asks the worker for the
    #: next waiting trial of the pack's queue (:class:`WantMember`, answered by :class:`NewMember`).
    refill: bool = False


class WantMember(_Message):
    """A pack's place ``index`` is free: the job process asks the worker for the next waiting
    trial of the pack's queue, and waits for the :class:`NewMember` answer."""

    kind: Literal["want_member"] = "want_member"
    index: int = Field(ge=0)


class NewMember(_Message):
    """The worker's answer to :class:`WantMember`: the trial that takes the place (its own
    message, lease and watch, taken as the pack's first members were), or None: no more."""

    kind: Literal["new_member"] = "new_member"
    member: RunJob | None = None


class StopJob(_Message):
    """Stop the running job ``job_id`` at its next ``ctx.progress()``, which raises the error
    of ``reason`` (JobCancelled, JobTimeout, WorkerStopped) with ``message``."""

    kind: Literal["stop"] = "stop"
    job_id: str
    reason: StopReason
    message: str
    #: Seconds the job has to stop before its process is ended (``None``: the policy's
    #: ``cancel_grace_s``); a self-fenced job's is bounded by its lease's TTL.
    grace_s: float | None = None
    #: A ``PREEMPT`` stop's: the level of the work the job makes way for.
    level: Level | None = None


class Proceed(_Message):
    """The worker has failed the gang with the reason of a :class:`RankFailed`: the rank may
    take its process group down (its peers then find the reason)."""

    kind: Literal["proceed"] = "proceed"


class Report(_Message):
    """A running job's progress (already throttled by the job process)."""

    kind: Literal["progress"] = "progress"
    fields: dict[str, JsonValue]
    #: Set when the report is a pack member's (:class:`RunPack`).
    job_id: str | None = None


class LogLines(_Message):
    """A batch of a running command's output lines, ``[stream, text]`` with stream ``out`` or
    ``err``: the worker appends it to ``keys.command_log(job id)``."""

    kind: Literal["log"] = "log"
    lines: list[tuple[Literal["out", "err"], str]]


class StoreOpened(_Message):
    """Rank 0's ``TCPStore`` listens on ``port`` (of the rank's ``master_addr``): the worker
    publishes it to the gang's other ranks."""

    kind: Literal["store"] = "store"
    port: int = Field(gt=0, lt=65536)


class RankFailed(_Message):
    """A rank's job raised an error of its own: the worker fails the gang with ``reason`` and
    answers :class:`Proceed` before the rank takes its process group down."""

    kind: Literal["rank_failed"] = "rank_failed"
    reason: str


#: The messages from the job process that a run mode answers (a gang's: :mod:`tasks.worker.gang`):
#: the supervisor hands each to its watch's ``heard`` and sends back the answer it returns. A
#: new such message is added here, by its sender, and in the one run mode that answers it.
ModeMessage = StoreOpened | RankFailed


class Outcome(str, Enum):
    """How a run ended (where its message goes then: :func:`tasks.worker.disposition.settle`)."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    #: A rank or a group gives its devices to earlier work (:class:`~tasks.core.errors.GiveWay`).
    GIVE_WAY = "give_way"
    #: A member of a pack that its pack could not run to its end (the pack's process died, or
    #: its leader ended before the pack started: :mod:`tasks.worker.pack`). Never a job
    #: process's own saying.
    UNPACK = "unpack"
    #: A rank's gang lost a peer (:class:`~tasks.core.errors.PeerLost`): the worker's gang runs
    #: it again in the next generation.
    PEER_LOST = "peer_lost"
    #: The job made way for higher-level work (:class:`~tasks.core.errors.Preempted`).
    PREEMPTED = "preempted"
    #: Its worker stopped it, cut off from Redis or superseded by a newer attempt (self-fencing,
    #: :meth:`tasks.worker.lease.LeaseKeeper.must_stop`): no result of this attempt is stored; its
    #: lease expires and the job is given back. The worker's own: a job process ends such a job
    #: as ``error`` (its ``WorkerStopped``), and the stop sent makes it ``fenced``
    #: (:meth:`tasks.worker.runloop.Ended.under`).
    FENCED = "fenced"
    #: Its device failed under it (:class:`~tasks.core.errors.DeviceFailed`, decided by the
    #: worker's health service). The worker's own.
    DEVICE_FAILED = "device_failed"


#: The error a stopped job ends with, and its outcome, by the reason it was stopped: raised by
#: ``ctx.progress()`` in the job process, or given by the worker when it had to end the process.
STOPS: dict[StopReason, tuple[type[DeviceFleetError], Outcome]] = {
    StopReason.CANCEL: (JobCancelled, Outcome.CANCELLED),
    StopReason.TIMEOUT: (JobTimeout, Outcome.ERROR),
    StopReason.SHUTDOWN: (WorkerStopped, Outcome.ERROR),
    StopReason.GANG: (PeerLost, Outcome.PEER_LOST),
    StopReason.FENCED: (WorkerStopped, Outcome.FENCED),
    StopReason.PREEMPT: (Preempted, Outcome.PREEMPTED),
    StopReason.DEVICE_FAILED: (DeviceFailed, Outcome.DEVICE_FAILED),
}


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
    #: Set for a pack member (:class:`RunPack`); its ``retire`` retires the process after the pack.
    job_id: str | None = None
    #: Seconds the job's own run took in its process, its process's start not counted (a
    #: black hole's "fast failure" is judged on it); None where not measured (a pack's member).
    run_s: float | None = None


FromWorker = Annotated[ProcessSpec | RunJob | RunPack | StopJob | Proceed | NewMember, Field(discriminator="kind")]
FromJobProcess = Annotated[Hello | Refused | Report | LogLines | StoreOpened | RankFailed | Finished | WantMember,
                           Field(discriminator="kind")]

_FROM_WORKER: TypeAdapter[Any] = TypeAdapter(FromWorker)
_FROM_JOB_PROCESS: TypeAdapter[Any] = TypeAdapter(FromJobProcess)


def decode_from_worker(data: bytes) -> ProcessSpec | RunJob | RunPack | StopJob | Proceed | NewMember:
    """A message the worker sent. Raises pydantic's ``ValidationError`` if it is not one."""
    message: ProcessSpec | RunJob | RunPack | StopJob | Proceed | NewMember = _FROM_WORKER.validate_json(data)
    return message


def decode_from_job_process(data: bytes) -> (Hello | Refused | Report | LogLines | StoreOpened | RankFailed | Finished
                                             | WantMember):
    """A message a job process sent. Raises pydantic's ``ValidationError`` if it is not one."""
    message: Hello | Refused | Report | LogLines | StoreOpened | RankFailed | Finished | WantMember = \
        _FROM_JOB_PROCESS.validate_json(data)
    return message
