"""Jobs for the tests only, allowlisted in the test fleet (never in a real one)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tasks.core.errors import DeviceFleetError
from tasks.core.job import JobContext, Packing, job


def _wait_for_file(path: str, timeout_s: float) -> None:
    """Wait until ``path`` exists (the test's signal); TimeoutError after ``timeout_s``."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:g} s")
        time.sleep(0.05)


class FailParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str = "boom"


@job("fail", params=FailParams)
def fail(ctx: JobContext, params: FailParams) -> dict[str, Any]:
    """Raise ValueError(message): a job that fails on purpose."""
    raise ValueError(params.message)


class EchoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: Any = None


@job("echo", params=EchoParams)
def echo(ctx: JobContext, params: EchoParams) -> dict[str, Any]:
    """Return the value, the device and the pid: a no-op job."""
    return {"value": params.value, "device": ctx.device, "pid": os.getpid()}


class HoldParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = 3
    release_file: str
    timeout_s: float = 120.0


@job("hold", params=HoldParams)
def hold(ctx: JobContext, params: HoldParams) -> dict[str, Any]:
    """Report progress ``steps`` times, then wait until ``release_file`` exists: a job a test
    can watch while it runs, released when the test has seen what it wanted."""
    for step in range(1, params.steps + 1):
        ctx.progress(step=step, total=params.steps, loss=1.0 / step)
    _wait_for_file(params.release_file, params.timeout_s)
    return {"steps": params.steps, "device": ctx.device, "pid": os.getpid()}


class TrialParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A folder where each run appends a line to ``<marker>/<job id>``: the tests count runs.
    marker: str
    seconds: float = 0.0
    #: Report ``ctx.progress(step=i, steps=steps, value=score)`` this many times.
    steps: int = 0
    score: float = 0.0
    fail: bool = False


@job("counted", params=TrialParams)
def counted(ctx: JobContext, params: TrialParams) -> dict[str, Any]:
    """A sweep trial the tests can count: one line per run in ``marker/<job id>``, ``seconds``
    of sleep split over ``steps`` reports, then ``score`` (or ValueError if ``fail``)."""
    import time
    from pathlib import Path

    with open(Path(params.marker) / ctx.job_id, "a") as handle:
        handle.write(f"{os.getpid()}\n")
    slices = max(params.steps, 1)
    for step in range(1, slices + 1):
        time.sleep(params.seconds / slices)
        if params.steps:
            ctx.progress(step=step, steps=params.steps, value=params.score)
    if params.fail:
        raise ValueError(f"trial with score {params.score} failed on purpose")
    return {"score": params.score, "device": ctx.device, "pid": os.getpid()}


class RankedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: ``all_reduce`` this many times, sleeping ``seconds`` and reporting progress after each.
    steps: int = 1
    seconds: float = 0.0
    #: This rank raises ValueError at its first step: a rank's own error.
    fail_rank: int | None = None
    #: This rank's process dies (``os._exit(7)``) at its first step of the gang's first run.
    crash_rank: int | None = None
    #: A folder where each run appends a line to ``<marker>/<device>``: the tests count runs.
    marker: str | None = None
    #: After its first step, each rank reports (``waiting``) until this file exists.
    release_file: str | None = None


@job("ranked", params=RankedParams)
def ranked(ctx: JobContext, params: RankedParams) -> dict[str, Any]:
    """A rank of a distributed job: sums ``rank + 1`` over the group ``steps`` times and returns
    what the rank saw (its torchrun variables, its CUDA_VISIBLE_DEVICES)."""
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    if params.marker is not None:
        with open(Path(params.marker) / ctx.device, "a") as handle:
            handle.write(f"{os.getpid()} {ctx.distributed.restarts if ctx.distributed else -1}\n")
    total = 0.0
    for step in range(1, params.steps + 1):
        if params.fail_rank == ctx.rank:
            raise ValueError(f"rank {ctx.rank} fails on purpose")
        if params.crash_rank == ctx.rank and ctx.distributed is not None and ctx.distributed.restarts == 0:
            os._exit(7)
        value = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(value, group=ctx.process_group)
        total = float(value.item())
        time.sleep(params.seconds)
        ctx.progress(step=step, steps=params.steps)
        while params.release_file is not None and not Path(params.release_file).exists():
            ctx.progress(step=step, steps=params.steps, waiting=True)
            time.sleep(0.02)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    return {"sum": total, "env": {name: os.environ.get(name) for name in names},
            "initialized": dist.is_initialized(), "pid": os.getpid(),
            "local_rank": ctx.local_rank}


class SandboxParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Files to create: each reports "ok" or the errno's name.
    write: list[str] = []
    #: Device nodes to open read-write: each reports "opened" or the errno's name.
    open: list[str] = []
    #: Files to read: each reports "ok" or the errno's name.
    read: list[str] = []


@job("sandbox", params=SandboxParams)
def sandbox(ctx: JobContext, params: SandboxParams) -> dict[str, Any]:
    """What the worker's sandbox lets a job do: write the given files, open the given device
    nodes, see other processes."""
    import errno

    opens: dict[str, str] = {}
    for path in params.open:
        try:
            os.close(os.open(path, os.O_RDWR))
            opens[path] = "opened"
        except OSError as exc:
            opens[path] = errno.errorcode.get(exc.errno or 0, str(exc))
    writes: dict[str, str] = {}
    for path in params.write:
        try:
            with open(path, "w") as handle:
                handle.write("written by a job\n")
            writes[path] = "ok"
        except OSError as exc:
            writes[path] = errno.errorcode.get(exc.errno or 0, str(exc))
    reads: dict[str, str] = {}
    for path in params.read:
        try:
            with open(path) as handle:
                handle.read()
            reads[path] = "ok"
        except OSError as exc:
            reads[path] = errno.errorcode.get(exc.errno or 0, str(exc))
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    with open("/proc/self/status") as status:
        capabilities = {line.split(":")[0]: int(line.split(":")[1], 16) for line in status
                        if line.startswith(("CapPrm", "CapEff", "CapAmb", "CapInh"))}
    return {"writes": writes, "opens": opens, "reads": reads, "visible_pids": pids, "uid": os.getuid(),
            "gid": os.getgid(), "groups": os.getgroups(), "pid": os.getpid(), "ppid": os.getppid(),
            "capabilities": capabilities, "home": os.environ.get("HOME"), "artifacts_dir": str(ctx.artifacts_dir),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


# -- jobs that misbehave the way research code does (tests/test_isolation.py) -----------------


class CrashParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: ``segv``: die as a native extension dies; ``exit``: ``os._exit(status)``.
    how: str = "segv"
    status: int = 3


@job("crash", params=CrashParams)
def crash(ctx: JobContext, params: CrashParams) -> dict[str, Any]:
    """Print a line, then kill the job's process (SIGSEGV, or ``os._exit``)."""
    import signal

    print(f"about to crash ({params.how}) in {os.getpid()}", flush=True)
    if params.how == "exit":
        os._exit(params.status)
    os.kill(os.getpid(), signal.SIGSEGV)
    return {}


class HangParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A file the job writes its pid and its subprocess's pid to once it hangs.
    marker: str


@job("hang", params=HangParams)
def hang(ctx: JobContext, params: HangParams) -> dict[str, Any]:
    """Start a subprocess (as a DataLoader starts workers), then hang without ever reporting."""
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "600"])
    with open(params.marker, "w") as handle:
        handle.write(f"{os.getpid()} {child.pid}\n")
    while True:  # a deadlocked data loader: no ctx.progress(), ever
        time.sleep(0.05)


#: What :func:`leak` keeps alive across jobs in its process, as research code keeps a cache.
_LEAKED: list[bytearray] = []


class LeakParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mib: int = 200


@job("leak", params=LeakParams)
def leak(ctx: JobContext, params: LeakParams) -> dict[str, Any]:
    """Keep ``mib`` MiB more in a module global (touched, so it is resident)."""
    _LEAKED.append(bytearray(b"x" * (params.mib * 2**20)))
    return {"pid": os.getpid(), "held_mib": len(_LEAKED) * params.mib}


class RewriteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rewrite: bool = True


@job("environment", params=RewriteParams)
def environment(ctx: JobContext, params: RewriteParams) -> dict[str, Any]:
    """Report what the job sees (visible devices, a variable, the working directory, sys.path's
    head); with ``rewrite``, then change all of them, as a careless script does."""
    import sys

    seen = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "marker": os.environ.get("JOB_MARKER"),
            "cwd": os.getcwd(), "sys_path_0": sys.path[0], "pid": os.getpid()}
    if params.rewrite:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
        os.environ["JOB_MARKER"] = "left behind"
        os.chdir("/")
        sys.path.insert(0, "/nonexistent")
    return seen


class MeetParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    folder: str
    #: How many jobs (this one included) must have started before it returns.
    count: int = 2
    timeout_s: float = 60.0


@job("meet", params=MeetParams)
def meet(ctx: JobContext, params: MeetParams) -> dict[str, Any]:
    """Write ``<folder>/<job id>.started`` (pid, slot, cores), then wait until ``count`` such files
    exist: jobs that return have run at the same time, however fast the machine."""
    import json
    import time
    from pathlib import Path

    folder = Path(params.folder)
    folder.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "slot": ctx.slot, "cores": ctx.cores, "threads": ctx.threads}
    (folder / f"{ctx.job_id}.started").write_text(json.dumps(mine))
    deadline = time.monotonic() + params.timeout_s
    while len(list(folder.glob("*.started"))) < params.count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(folder.glob('*.started')))} of {params.count} jobs started "
                               f"within {params.timeout_s:g} s")
        ctx.progress()
        time.sleep(0.02)
    return mine


class HogParams(BaseModel):
    """What ``hog`` and ``gpu_hog`` hold, and the file that releases them."""

    model_config = ConfigDict(extra="forbid")
    mib: int
    release_file: str
    timeout_s: float = 120.0


@job("hog", params=HogParams)
def hog(ctx: JobContext, params: HogParams) -> dict[str, Any]:
    """Hold ``mib`` MiB (touched, so it is resident) until ``release_file`` exists."""
    held = bytearray(b"x") * (params.mib * 2**20)  # one allocation, every page written
    _wait_for_file(params.release_file, params.timeout_s)
    return {"held_mib": len(held) // 2**20, "pid": os.getpid()}


@job("gpu_hog", params=HogParams)
def gpu_hog(ctx: JobContext, params: HogParams) -> dict[str, Any]:
    """Allocate ``mib`` MiB on the job's device, then hold it until ``release_file`` exists."""
    import torch

    held = torch.ones(params.mib * 2**18, dtype=torch.float32, device=ctx.torch_device)
    _wait_for_file(params.release_file, params.timeout_s)
    return {"held_mib": held.numel() * 4 // 2**20, "pid": os.getpid()}


class SnoopParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: The fleet's secrets, which the test knows: the scan says where it finds any of them.
    needles: list[str] = []
    #: Files to try to read as well (a deployed host's environment files).
    paths: list[str] = []


@job("snoop", params=SnoopParams)
def snoop(ctx: JobContext, params: SnoopParams) -> dict[str, Any]:
    """Look for the fleet's keys where a job could find them and try them (tests/scripts/snoop.py)."""
    import runpy
    from pathlib import Path

    scan = runpy.run_path(str(Path(__file__).parent / "scripts" / "snoop.py"))["scan"]
    return {"snoop": scan(params.needles, params.paths)}


class StampParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A file each run appends ``label`` to, one line per run: the order of its lines is the
    #: order the jobs started in (on one device, one at a time).
    path: str
    label: str


@job("stamp", params=StampParams)
def stamp(ctx: JobContext, params: StampParams) -> dict[str, Any]:
    """Append ``label`` to ``path`` as the job starts: the tests read the order of starts."""
    with open(params.path, "a", encoding="utf-8") as out:
        out.write(params.label + "\n")
    return {"label": params.label, "device": ctx.device}


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@job("gpu_memory", params=NoParams)
def gpu_memory(ctx: JobContext, params: NoParams) -> dict[str, Any]:
    """What the job's device holds as it starts: this process's CUDA allocator (allocated,
    reserved: what a job before it in this process left) and the device's used memory (MiB)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "used_mib": round((total - free) / 2**20), "pid": os.getpid()}


class GroupProbeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Wait for this file before returning (a test's signal); None: return at once.
    release_file: str | None = None
    #: Start a child process (``sleep``) and write its pid here, then wait at ``ctx.progress()``
    #: until cancelled: a group job whose process tree a cancel must end.
    child_pid_file: str | None = None
    timeout_s: float = 120.0


@job("group_probe", params=GroupProbeParams)
def group_probe(ctx: JobContext, params: GroupProbeParams) -> dict[str, Any]:
    """What a device group's job process sees: ``ctx.devices``, its cores, its affinity, torch's
    threads, ``CUDA_VISIBLE_DEVICES``; optionally wait for a file, or start a child and report
    until cancelled."""
    import subprocess
    import time

    import torch

    started = time.time()
    if params.child_pid_file:
        child = subprocess.Popen(["sleep", "300"])
        tmp = f"{params.child_pid_file}.tmp"
        with open(tmp, "w") as out:
            out.write(str(child.pid))
        os.replace(tmp, params.child_pid_file)
        deadline = time.monotonic() + params.timeout_s
        while time.monotonic() < deadline:
            ctx.progress(waiting=True)
            time.sleep(0.05)
    if params.release_file:
        _wait_for_file(params.release_file, params.timeout_s)
    return {"devices": ctx.devices, "device": ctx.device, "cores": ctx.cores,
            "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
            "ppid": os.getppid(), "started": started, "ended": time.time()}


class ResumableParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A file each run appends its events to (``<label> start <attempt> <step>``, ``<label>
    #: preempted <step>``, ``<label> done <step>``): the tests read their order.
    path: str
    label: str
    steps: int = Field(ge=1)
    #: After this step the run keeps reporting until ``release_file`` exists.
    hold_at: int = Field(ge=0)
    release_file: str
    timeout_s: float = 60.0
    #: Seconds each step takes (a trial of ``steps * step_s`` seconds).
    step_s: float = Field(default=0.0, ge=0)


@job("resumable", params=ResumableParams)
def resumable(ctx: JobContext, params: ResumableParams) -> dict[str, Any]:
    """Count to ``steps``, one checkpoint (``<artifacts>/step``) per step, resuming from the
    last one; it checkpoints again when preempted (``ctx.preempted()``), then lets
    ``ctx.progress()`` raise. Its events show where each run started and ended."""
    import time
    from pathlib import Path

    from tasks.core.errors import Preempted

    checkpoint = ctx.artifacts_dir / "step"
    ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
    step = int(checkpoint.read_text()) if checkpoint.exists() else 0

    def event(what: str) -> None:
        with open(params.path, "a", encoding="utf-8") as out:
            out.write(f"{params.label} {what} {step}\n")

    event(f"start {ctx.attempt}")
    deadline = time.monotonic() + params.timeout_s
    try:
        while step < params.steps:
            if step >= params.hold_at and not Path(params.release_file).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{params.release_file} did not appear in {params.timeout_s:g} s")
                time.sleep(0.02)
            else:
                time.sleep(params.step_s)
                step += 1
                checkpoint.write_text(str(step))
            if ctx.preempted():
                checkpoint.write_text(str(step))
            ctx.progress(step=step, total=params.steps)
    except Preempted:
        event("preempted")
        raise
    event("done")
    return {"step": step, "attempt": ctx.attempt}


# -- the GPU checks of issues 39-41 (tests/test_gpu_issues.py) ------------------------------------


def _event(path: str, what: str) -> None:
    """Append ``<what> <pid>`` to ``path``: the order of a test's jobs' starts and stops."""
    with open(path, "a", encoding="utf-8") as out:
        out.write(f"{what} {os.getpid()}\n")


def _ballast(ctx: JobContext, mib: int) -> Any:
    """``mib`` MiB allocated (and written) on the job's device, resident once this returns."""
    import torch

    held = torch.ones(mib * 2**18, dtype=torch.float32, device=ctx.torch_device)
    if held.is_cuda:
        torch.cuda.synchronize()
    return held


class BallastParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: MiB held on the job's device by its first run (``ctx.attempt == 1``); a run again holds none.
    mib: int = Field(ge=0)
    #: Each run appends ``start <pid>`` here once it holds its memory, ``stopped <pid>`` if it
    #: is stopped (its ctx.progress() raised).
    events: str
    release_file: str
    timeout_s: float = 120.0


@job("ballast_tick", params=BallastParams)
def ballast_tick(ctx: JobContext, params: BallastParams) -> dict[str, Any]:
    """Hold ``mib`` MiB on the device and report progress every 50 ms until ``release_file``
    exists: a running job that holds device memory, for a fence or a stop to end."""
    import time
    from pathlib import Path

    held = _ballast(ctx, params.mib if ctx.attempt == 1 else 0)
    _event(params.events, "start")
    deadline = time.monotonic() + params.timeout_s
    try:
        while not Path(params.release_file).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{params.release_file} did not appear in {params.timeout_s:g} s")
            ctx.progress(ticking=True)
            time.sleep(0.05)
    except DeviceFleetError:
        _event(params.events, "stopped")
        raise
    return {"held_mib": held.numel() * 4 // 2**20, "attempt": ctx.attempt, "pid": os.getpid()}


class BallastTrainParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: MiB held on the device beside the model for the whole run (every run).
    mib: int = Field(ge=0)
    #: As :class:`BallastParams`' ``events``.
    events: str
    #: Each epoch lasts at least this long (a sleep before its report): a fast GPU cannot end
    #: the run before the test's urgent job can preempt it.
    epoch_s: float = Field(default=0.0, ge=0)
    #: ``train``'s own parameters.
    train: dict[str, Any] = {}


@job("ballast_train", params=BallastTrainParams)
def ballast_train(ctx: JobContext, params: BallastTrainParams) -> dict[str, Any]:
    """The ``train`` job with ``mib`` MiB held on its device and paced epochs; its output is
    train's, plus the ballast and the pid."""
    import time

    from tasks.jobs.train import TrainParams, train

    held = _ballast(ctx, params.mib)
    _event(params.events, "start")
    report = ctx.progress

    def paced(**fields: Any) -> None:
        time.sleep(params.epoch_s)
        report(**fields)

    ctx.progress = paced  # type: ignore[method-assign]
    try:
        out = train(ctx, TrainParams(**params.train))
    except DeviceFleetError:
        _event(params.events, "stopped")
        raise
    return {**out, "held_mib": held.numel() * 4 // 2**20, "pid": os.getpid()}


class MemoryProbeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A ballast job's events file: this job appends ``probe <pid>`` to it as it starts, and
    #: says which pids that started there are still alive (ended, or running a job).
    events: str | None = None


@job("memory_probe", params=MemoryProbeParams)
def memory_probe(ctx: JobContext, params: MemoryProbeParams) -> dict[str, Any]:
    """As it starts: the device's free and total memory (MiB; None on a CPU) and which of the
    pids that started in ``events``, other than its own, are still alive."""
    from pathlib import Path

    import psutil
    import torch

    free = total = None
    if ctx.torch_device.startswith("cuda"):
        free_b, total_b = torch.cuda.mem_get_info(torch.device(ctx.torch_device))
        free, total = free_b // 2**20, total_b // 2**20
    pids: list[int] = []
    if params.events:
        _event(params.events, "probe")
        pids = [int(line.split()[1]) for line in Path(params.events).read_text().splitlines()
                if line.startswith("start ")]

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    alive = [p for p in pids if p != os.getpid() and running(p)]
    return {"free_mib": free, "total_mib": total, "pids": pids, "alive": alive, "pid": os.getpid()}


class KeepParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mib: int = Field(default=512, ge=0)


#: Tensors ``gpu_keep`` leaves behind in its process (on its device): the leak of issue 48.
_KEPT: list[Any] = []


@job("gpu_keep", params=KeepParams)
def gpu_keep(ctx: JobContext, params: KeepParams) -> dict[str, Any]:
    """Keep ``mib`` MiB on the job's device in a module global, and end fine."""
    import torch

    _KEPT.append(torch.ones(params.mib * 2**18, dtype=torch.float32, device=ctx.torch_device))
    return {"pid": os.getpid(), "kept_mib": params.mib}


@job("gpu_assert", params=NoParams)
def gpu_assert(ctx: JobContext, params: NoParams) -> dict[str, Any]:
    """Index out of range in a CUDA kernel: a device-side assert, which poisons the context.
    Returns without synchronising, so the error surfaces only when the job process releases
    the job's memory (as an asynchronous kernel error does)."""
    import torch

    table = torch.zeros(4, device=ctx.torch_device)
    index = torch.tensor([1_000_000], device=ctx.torch_device)
    table[index] += 1  # the kernel's bounds check fires on the device, not here
    return {"pid": os.getpid()}


@job("break_process", params=NoParams)
def break_process(ctx: JobContext, params: NoParams) -> dict[str, Any]:
    """Mark this job process broken, as a CUDA error found only after a pack's last member had
    ended does (``JobRuntime.broken``): a stand-in, since no CPU job can break a CUDA context.
    The job itself ends ok; whatever the process is sent next must not run in it."""
    import gc

    from tasks.jobproc.runtime import JobRuntime

    runtimes = [found for found in gc.get_objects() if isinstance(found, JobRuntime)]
    for runtime in runtimes:
        runtime.broken = "broken by tests/fleet_jobs.py's break_process"
    return {"pid": os.getpid(), "runtimes": len(runtimes)}


class PackedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: int = 2
    batch_size: int = 16
    lr: float = 1e-2
    seed: int = 0
    #: Kill the job process while this trial's data is made (a trial that takes its pack down).
    crash: bool = False
    #: Data that is all NaN: the trial's loss is not finite (a packed trial ends TrainingDiverged).
    diverge: bool = False


def _packed_data(params: PackedParams) -> Any:
    import torch

    from tasks.core.job import PackData

    if params.crash:
        os._exit(7)
    generator = torch.Generator().manual_seed(params.seed)
    x = torch.randn(64, 4, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    if params.diverge:
        x[:] = float("nan")
    return PackData(x_train=x[:48], y_train=y[:48], x_test=x[48:], y_test=y[48:])


def _packed_model(params: PackedParams, data: Any) -> Any:
    import torch

    return torch.nn.Linear(4, 2)


@job("packed", params=PackedParams, pack=Packing(key=("epochs", "batch_size"), model=_packed_model, data=_packed_data))
def packed(ctx: JobContext, params: PackedParams) -> dict[str, Any]:
    """A tiny packable classifier: ``epochs`` long (a progress report each), or a crash."""
    import torch

    torch.manual_seed(params.seed)
    split = _packed_data(params)
    net = _packed_model(params, split)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.lr)
    for epoch in range(1, params.epochs + 1):
        for start in range(0, len(split.y_train), params.batch_size):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(split.x_train[start:start + params.batch_size]),
                                                     split.y_train[start:start + params.batch_size])
            loss.backward()
            optimizer.step()
        ctx.progress(epoch=epoch, epochs=params.epochs)
    accuracy = (net(split.x_test).argmax(dim=1) == split.y_test).float().mean().item()
    return {"accuracy": accuracy, "packed": None}


#: What the ``remember`` jobs run in this process kept: the module global a job of one user must
#: never find another user's value in.
_KEPT: list[str] = []


class RememberParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str


@job("remember", params=RememberParams)
def remember(ctx: JobContext, params: RememberParams) -> dict[str, Any]:
    """Keep ``value`` in a module global; return what earlier jobs of this process kept and the pid."""
    seen = list(_KEPT)
    _KEPT.append(params.value)
    return {"pid": os.getpid(), "seen": seen}

class BlackHoleParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: A folder where each run appends its device to ``<marker>/<job id>``: the tests count runs.
    marker: str
    #: The device that fails every job at once (a black hole); ``"*"``: every device does.
    bad_device: str
    seconds: float = 0.0
    score: float = 0.0


@job("blackhole", params=BlackHoleParams)
def blackhole(ctx: JobContext, params: BlackHoleParams) -> dict[str, Any]:
    """Fail at once on ``bad_device`` (RuntimeError), else sleep ``seconds`` and return ``score``."""
    import time
    from pathlib import Path

    with open(Path(params.marker) / ctx.job_id, "a") as handle:
        handle.write(f"{ctx.device}\n")
    if params.bad_device in (ctx.device, "*"):
        raise RuntimeError(f"device {ctx.device} fails every job")
    time.sleep(params.seconds)
    return {"score": params.score, "device": ctx.device}
