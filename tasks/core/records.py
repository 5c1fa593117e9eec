"""Typed records that cross a process boundary: JSON at the edge, these models inside.

- :class:`Entry`: one device's result in a fan-out (the value of ``{device: entry}``);
- :class:`JobOptions`: per-job options that are not the job's own kwargs (a message header);
- :class:`DistributedOptions`, :class:`GangSpec`: a distributed job as asked, and as every rank
  receives it;
- :class:`GroupSpec`: a device group's job, as its leader receives it;
- :class:`WorkerRecord`: a device worker's entry in the fleet registry;
- :class:`LeaseRecord`: the lease of a running job, with what the reaper needs to send it again;
- :class:`DeadLetter`: a job that took its worker down too often and is not run again;
- :class:`FleetFile`: what ``devicefleet up`` writes for producers on the same host.

Where each lives in Redis is in :mod:`tasks.core.keys`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator

from .commands import CommandRules
from .defaults import GANG_COLLECTIVE_TIMEOUT_S, GANG_JOIN_TIMEOUT_S, GANG_MAX_RESTARTS, MAX_ATTEMPTS, PACK_MAX
from .errors import ConfigError
from .placement import Constraints, LabelValue
from .priority import DEFAULT_LEVEL, USER_PATTERN, Level, parse_level


class EntryStatus(str, Enum):
    OK = "ok"
    ERROR = "error"
    #: Cancelled before it started, or stopped at a ``ctx.progress()`` call (``handle.cancel()``).
    CANCELLED = "cancelled"


#: Error types that mean "cancelled", not "failed": the job's own stop at ``ctx.progress()`` (or
#: its process ended after the grace period), and Celery's for a revoked message that never started.
CANCELLED_ERRORS = frozenset({"JobCancelled", "TaskRevokedError"})


_Model = TypeVar("_Model", bound=BaseModel)


def stored(model: type[_Model], raw: str | bytes) -> _Model:
    """``raw``, JSON a process of the fleet stored (in Redis), as ``model``. A record refuses
    unknown fields where code builds it (a typo fails at once), but one stored by a newer version
    may carry fields this one does not know: those are left out, so that a rolling upgrade's new
    workers do not make their records unreadable to the older processes (a device vanished from
    the registry; a lease no reaper could read).

    Raises:
        ValidationError: anything else is wrong with it.
    """
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        unknown = [error["loc"] for error in exc.errors() if error["type"] == "extra_forbidden"]
        if not unknown or len(unknown) != exc.error_count():
            raise
        data = json.loads(raw)
        for loc in unknown:
            *path, last = loc
            node = data
            for part in path:
                node = node[part]
            del node[last]
        return model.model_validate(data)


class _Record(BaseModel):
    """A record: unknown fields are refused, values are JSON-able."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> str:
        return self.model_dump_json()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# -- the result entry -------------------------------------------------------------------------------


class ErrorInfo(_Record):
    """Why a job failed: the exception's type name and message (and memory figures on OOM)."""

    type: str
    message: str
    #: Memory figures when the device ran out of memory (:class:`tasks.core.errors.OutOfMemory`).
    memory: dict[str, JsonValue] | None = None
    #: How a command ended when it failed (:class:`tasks.core.errors.CommandFailed`):
    #: ``exit_code``, ``signal``, ``tail`` (its last lines), ``log`` (its log folder).
    command: dict[str, JsonValue] | None = None

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        memory = getattr(exc, "memory", None)
        command = getattr(exc, "command", None)
        return cls(type=type(exc).__name__, message=str(exc),
                   memory=memory if isinstance(memory, dict) else None,
                   command=command if isinstance(command, dict) else None)


class Visibility(_Record):
    """What the worker saw of its device."""

    cuda_visible_devices: str | None = None
    cuda_available: bool | None = None
    device_name: str | None = None


class Entry(_Record):
    """One device's entry in a fan-out's result dict. Its keys are fixed (:data:`ENTRY_KEYS`).

    Results reach producers as dicts (JSON at the edge); code that reads one goes through
    :meth:`parse` and compares :class:`EntryStatus`.
    """

    #: The device that ran the job; None for a sweep's trial cancelled before any device took it.
    device: str | None
    worker: str | None
    #: The device's slot that ran the job (0 on a device with one slot); None where it never ran.
    slot: int | None
    status: EntryStatus
    #: The job's own output; None on error.
    output: dict[str, JsonValue] | None
    #: Why it failed; None when ``status`` is ok.
    error: ErrorInfo | None
    started_at: str | None
    finished_at: str | None
    duration_s: float | None
    visibility: Visibility
    #: How many times higher-level work preempted the job before this run (each time it went
    #: back to its queue and ran again: :mod:`tasks.worker.preemption`).
    preemptions: int = 0

    @classmethod
    def make(cls, *, device: str, worker: str | None, output: dict[str, Any] | None,
             error: ErrorInfo | None, started: float | None, finished: float | None,
             visibility: Visibility | None = None, slot: int | None = None, preemptions: int = 0) -> Entry:
        """An entry; ``status`` is ok without ``error``, else error, or cancelled for the
        :data:`CANCELLED_ERRORS`."""
        status = EntryStatus.OK if error is None else (
            EntryStatus.CANCELLED if error.type in CANCELLED_ERRORS else EntryStatus.ERROR)
        return cls(
            device=device, worker=worker, slot=slot,
            status=status,
            output=None if error else output,
            error=error,
            started_at=iso(started), finished_at=iso(finished),
            duration_s=(finished - started) if started is not None and finished is not None else None,
            visibility=visibility or Visibility(), preemptions=preemptions,
        )

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> Entry:
        """The entry ``data`` holds: a value of a fan-out's result dict, or a sweep's trial
        entry (its own ``trial`` and ``kwargs`` keys are left out).

        Raises:
            pydantic.ValidationError: ``data`` is not an entry (a ``ValueError``).
        """
        return cls.model_validate({key: data[key] for key in ENTRY_KEYS if key in data})

    @property
    def ok(self) -> bool:
        """Whether the job succeeded (``status`` is :attr:`EntryStatus.OK`)."""
        return self.status is EntryStatus.OK

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        for extra in ("memory", "command"):  # {type, message}, plus memory only on OOM, command
            if out["error"] is not None and out["error"][extra] is None:  # only for a command
                del out["error"][extra]
        return out


#: The keys of every entry, in order.
ENTRY_KEYS: tuple[str, ...] = tuple(Entry.model_fields)


def iso(ts: float | None) -> str | None:
    """``ts`` (seconds since the epoch) as an ISO 8601 UTC string."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


# -- options beside the kwargs ---------------------------------------------------------------------


class DistBackend(str, Enum):
    """The ``torch.distributed`` backend of a distributed job."""

    #: nccl when every rank is a GPU device, else gloo (gloo also reduces CUDA tensors).
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class DistributedOptions(_Record):
    """How to run one job as the ranks of one ``torch.distributed`` group
    (``fan_out(job, devices, distributed={...})``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: DistBackend = DistBackend.AUTO
    #: How many times the whole gang runs again after a rank's worker died (from the job's
    #: last checkpoint); a job's own error is not retried.
    max_restarts: int = Field(default=GANG_MAX_RESTARTS, ge=0, le=100)
    #: How long a rank waits for the others to start; then the gang fails, naming the devices
    #: that did not come (they may be busy with other jobs: count their queue in).
    join_timeout_s: float = Field(default=GANG_JOIN_TIMEOUT_S, gt=0, le=86_400)
    #: How long a collective may wait for a peer (``init_process_group(timeout=...)``), instead
    #: of torch's 30 minutes; a dead peer's gloo connection fails at once.
    collective_timeout_s: float = Field(default=GANG_COLLECTIVE_TIMEOUT_S, gt=0, le=86_400)


class GangSpec(_Record):
    """A distributed job as each of its ranks receives it: rank ``i`` runs on ``devices[i]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    devices: list[str] = Field(min_length=1)
    #: The gang's age (a fleet-wide counter at send time): an older gang keeps a device that
    #: two assembling gangs both want (wait-die: tasks.worker.gang).
    seq: int = Field(ge=0)
    backend: Literal["gloo", "nccl"]
    max_restarts: int = Field(ge=0, le=100)
    join_timeout_s: float = Field(gt=0)
    collective_timeout_s: float = Field(gt=0)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def rank_of(self, device: str) -> int:
        """The rank of ``device``.

        Raises:
            ValueError: the device is not one of the gang's.
        """
        return self.devices.index(device)


class GroupSpec(_Record):
    """A device group as its job's message carries it: one job, in one job process, over
    ``devices`` of one host at once; ``devices[0]``'s worker (the leader) takes the message,
    reserves the others and runs it (:mod:`tasks.worker.group`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    devices: list[str] = Field(min_length=2)
    #: The group's age (a fleet-wide counter at send time): of two groups that want one device,
    #: the younger gives way (wait-die), as gangs do.
    seq: int = Field(ge=0)
    #: The attempt under which its producer reserved the group's other devices as it sent it
    #: (:func:`tasks.core.group_reservation.reserve_at_send`); its leader claims it while it is
    #: alive, else reserves anew. None: the leader reserves them all when it takes the message.
    reservation: str | None = Field(default=None, min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_.\-]+$")

    @property
    def name(self) -> str:
        """``cpu0+cpu1``: the group's key in a fan-out's result."""
        return "+".join(self.devices)

    @property
    def leader(self) -> str:
        return self.devices[0]


class JobOptions(_Record):
    """Options of one job run that are not the job's own kwargs.

    They travel in the message header :data:`tasks.core.keys.OPTIONS_HEADER`, so a job may have
    a parameter of any name.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Where to run the job again if the device runs out of memory: ``"cpu"``, or None.
    fallback: Literal["cpu"] | None = None
    #: Set on each rank of a distributed job (``fan_out(..., distributed=True)``).
    gang: GangSpec | None = None
    #: Set on a device group's job (``fan_out(..., group=2)``): the devices it runs over.
    group: GroupSpec | None = None
    #: End the job as ``JobTimeout`` after this many seconds (None: the worker config's
    #: ``max_job_seconds``).
    time_limit_s: float | None = Field(default=None, gt=0, le=30 * 86_400)
    #: Runs of the job that may take their whole worker down before it ends as ``WorkerLost``
    #: (a crash of the job's own process is an error entry at once, not an attempt).
    max_attempts: int = Field(default=MAX_ATTEMPTS, ge=1, le=100)
    #: The job's level (:mod:`tasks.core.priority`): a free device takes the highest first.
    priority: Level = DEFAULT_LEVEL
    #: Who sent the job; None until it is sent (then the ``user`` setting, else the OS user).
    user: str | None = Field(default=None, pattern=USER_PATTERN)
    #: Whether higher-level work waiting for the device may preempt the job (False: it runs to
    #: its end, as Slurm's ``PreemptMode=OFF`` for one job).
    preemptible: bool = True
    #: Set on a packed sweep's trial (``sweep(..., pack=K)``): the worker that takes it runs it
    #: with up to K-1 more trials of its queue as one packed model; ``"auto"``: as many as fit
    #: the slot's budget. None: the trial runs alone.
    pack: int | Literal["auto"] | None = None
    #: What the device that runs the job must be (:mod:`tasks.core.placement`): the producer sends
    #: it only to matching devices; a worker whose device does not match hands it back.
    constraints: Constraints | None = None

    @field_validator("priority", mode="before")
    @classmethod
    def _check_priority(cls, value: object) -> Level:
        return parse_level(value)  # its ConfigError names the value and the levels

    @field_validator("pack", mode="before")
    @classmethod
    def _check_pack(cls, value: object) -> int | str | None:
        return parse_pack(value)

    @property
    def is_default(self) -> bool:
        return self == JobOptions()


def parse_pack(value: object) -> int | str | None:
    """``pack=``: None, a trial count >= 1, or ``"auto"``.

    Raises:
        ConfigError: anything else; the message names the value.
    """
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= PACK_MAX:
        return value
    raise ConfigError(f"pack={value!r}: give a number of trials to train as one model (1 to {PACK_MAX}), "
                      "or 'auto' to fit as many as the slot's memory allows (nothing was sent)")


# -- the registry ----------------------------------------------------------------------------------


class BusyInfo(_Record):
    """The job a worker runs now."""

    job: str
    job_id: str
    since: float
    #: The job's level and who sent it (:class:`JobOptions`).
    level: Level = DEFAULT_LEVEL
    user: str | None = None


class SlotRecord(_Record):
    """One slot of a device worker: a job process that runs one job at a time, with its cores
    and its memory budget (:mod:`tasks.worker.slots`)."""

    index: int
    cores: list[int]
    #: Bytes a job in this slot may use (device memory on a GPU, resident memory on a CPU
    #: device); None: not enforced.
    budget_bytes: int | None = None
    #: The job the slot runs now.
    busy: BusyInfo | None = None
    #: The running job's latest ``ctx.progress`` fields.
    progress: dict[str, JsonValue] | None = None
    #: The running job's memory at the last sample (what its budget is compared with).
    memory_bytes: int | None = None


class WorkerRecord(_Record):
    """A device worker's registry record (``keys.worker(device)``), refreshed by its heartbeat."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str
    kind: str
    worker: str
    host: str
    pid: int
    #: The queues it consumes, in order within a level; it takes each one's list of every level
    #: (:func:`tasks.core.queue_lists.leveled`).
    queues: list[str]
    cores: list[int]
    pool: str
    #: The device's slots (``slots`` in its worker config): the jobs it runs at once.
    slots: list[SlotRecord] = Field(default_factory=list)
    #: What the slots' budgets count: ``"device"`` (GPU memory, NVML), ``"resident"`` (RAM).
    memory_kind: Literal["device", "resident"] = "resident"
    #: The jobs this worker may run (its allowlist's), as ``devicefleet.<job>`` task names' suffixes.
    jobs: list[str]
    #: ``{job: the params that must be equal for trials to share a pack}`` of its jobs that pack
    #: (:attr:`tasks.core.wire.JobInfo.pack`): what ``sweep(..., pack=)`` checks.
    packable: dict[str, list[str]] = Field(default_factory=dict)
    started_at: float
    cuda_visible_devices: str | None = None
    cuda_available: bool | None = None
    device_name: str | None = None
    total_memory: int | None = None
    torch_version: str | None = None
    torch_threads: int | None = None
    #: True once the worker consumes its queues.
    ready: bool = False
    jobs_done: int = 0
    heartbeat_at: float | None = None
    #: The worker's job processes alive now (the one running a job first), where its jobs run.
    job_pids: list[int] = Field(default_factory=list)
    #: Those of them that ran no job yet: the spares any user's job may take (a job process runs
    #: one user's jobs: :mod:`tasks.worker.owners`).
    spare_pids: list[int] = Field(default_factory=list)
    #: The programs and folders commands may use here (its worker config's ``[commands]``,
    #: resolved when it started); None: it runs no commands.
    commands: CommandRules | None = None
    #: A GPU's links to the other GPUs of its host, read from NVML when the worker started
    #: (:mod:`tasks.worker.topology`): ``{other GPU's index: link}``, the link a
    #: :class:`~tasks.core.groups.Link` name in lower case (``"nvlink"``, ``"pcie_switch"``...).
    #: None where nothing was read: a CPU device, or no NVML. The producer's choice of a GPU
    #: group's devices reads it (:func:`tasks.core.groups.choose_groups`).
    gpu_links: dict[int, str] | None = None
    #: A GPU's CUDA compute capability, ``"9.0"``; None on a CPU device (:mod:`tasks.core.placement`).
    compute_capability: str | None = None
    #: Bytes of its host's RAM, read as it started: what a CPU device's jobs may use where its
    #: slots have no budget (``memory_gib``); None from a worker older than this field.
    host_memory: int | None = None
    #: What its worker config's ``labels`` say the device is (``{"nvlink": true, "rack": "a"}``):
    #: what jobs' ``labels`` constraints match.
    labels: dict[str, LabelValue] = Field(default_factory=dict)

    def same_process(self, host: str, pid: int) -> bool:
        return self.host == host and self.pid == pid

    @property
    def slot_count(self) -> int:
        """Jobs the device runs at once (1 for a record without slots)."""
        return max(1, len(self.slots))

    @property
    def running(self) -> list[SlotRecord]:
        """The slots that run a job now."""
        return [slot for slot in self.slots if slot.busy is not None]

    @property
    def busy(self) -> BusyInfo | None:
        """The job of the first busy slot (the longest running); None when every slot is idle."""
        running = sorted(self.running, key=lambda slot: slot.busy.since if slot.busy else 0.0)
        return running[0].busy if running else None


# -- leases ----------------------------------------------------------------------------------------


class ResendRecord(_Record):
    """What the reaper needs to send a job again when its message is gone from Redis."""

    name: str
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    queue: str | None = None
    headers: dict[str, JsonValue] = Field(default_factory=dict)
    chord: dict[str, JsonValue] | None = None
    group_id: str | None = None
    group_index: int | None = None
    root_id: str | None = None
    parent_id: str | None = None


class LeaseRecord(_Record):
    """The lease of a running job (``keys.lease(task_id)``, and in the ``keys.LEASES`` hash)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The attempt's fencing token (``keys.fence``): ``None`` until the take script stamps the
    #: one it issues into the stored value. First, so that its place in the JSON is known.
    token: int | None = None
    device: str
    worker: str
    pid: int
    host: str
    task_id: str
    delivery_tag: str | None = None
    since: float
    resend: ResendRecord | None = None
    #: The user the job runs for (``None``: none named): what a cap counts
    #: (:mod:`tasks.core.caps`), with the device's kind.
    user: str | None = None
    #: Whether the take script granted it over its user's cap, as borrowed work (a cap with
    #: ``borrow``): the script stores the record the taker wrote with it true, wherever it stands.
    borrowed: bool = False


class DeadLetter(_Record):
    """A job that took its whole worker down ``max_attempts`` times: it ended as ``WorkerLost``
    and is not run again (``keys.DEAD_LETTERS``; ``tasks.dead_letters()`` lists them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str
    #: The job's name (``train``), not its Celery task's.
    job: str
    #: The device whose worker refused to run it again, and the queue it came from.
    device: str
    queue: str | None = None
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    #: The workers it took down, oldest first: ``"<worker> pid <pid>"``.
    workers: list[str]
    max_attempts: int
    #: When it was given up (seconds since the epoch).
    at: float
    #: Its fan-out (the chord's group), to find the rest of it.
    group_id: str | None = None


# -- sweeps ----------------------------------------------------------------------------------------


class SweepRecord(_Record):
    """A sweep's own record (``keys.sweep(sweep_id)``): what a resumed producer checks and reads.

    The trials themselves are not stored (the command that runs the sweep again gives them);
    their digest is, so that a name reused for other trials is refused instead of mixed up.
    """

    sweep_id: str
    job: str
    #: sha256 of the job spec and the trials' kwargs, in order.
    digest: str
    trials: int = Field(ge=0)
    devices: list[str]
    queue: str
    created_at: float
    cancelled: bool = False


# -- the fleet file --------------------------------------------------------------------------------


class FleetDevice(_Record):
    cores: list[int]
    log: str


class FleetFile(_Record):
    """What a running ``devicefleet up`` writes to ``<state dir>/fleet.json`` (mode 0600)."""

    pid: int
    redis_url: str
    embedded_redis: bool
    devices: dict[str, FleetDevice] = Field(default_factory=dict)
    started_at: float
    flower_url: str | None = None
    flower_auth_file: str | None = None
    metrics_url: str | None = None
