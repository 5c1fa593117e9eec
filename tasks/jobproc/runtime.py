"""Running jobs in a job process: each from the state the process started in, to a :class:`Finished`.

:meth:`JobRuntime.prepare` pins the process to its cores, imports torch and the allowlist's job
modules and checks what torch sees, then remembers the environment, working directory,
``sys.path``, core affinity and torch threads. :meth:`JobRuntime.run` puts all of those back
before each job, whatever the job before it did (``os.environ["CUDA_VISIBLE_DEVICES"] = ...``,
``os.chdir("/")``), then runs it (:func:`run_job`; a pack of trials: :mod:`.pack_run`) and says how it ended, and whether this
process may run another: not after a CUDA error (the context may be poisoned: pytorch#2300, also
when it surfaces only as the job's memory is released), an out-of-memory, or with more than
``MAX_GPU_MEMORY_LEFT_MIB`` of device memory still allocated after the job (:func:`.oom.settle_device`).
A CUDA error found after a pack's members had all ended marks the process :attr:`JobRuntime.broken`:
it runs nothing more, and gives back whatever it is sent next (:meth:`JobRuntime.hand_back`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.accounts import own_capabilities
from ..core.defaults import MAX_GPU_MEMORY_LEFT_MIB
from ..core.devices import Device, check_visibility
from ..core.errors import DeviceFleetError, JobCancelled, JobError, NoJobAccount, OutOfMemory, PeerLost, Preempted
from ..core.job import JobContext, JobDefinition, JobFunc
from ..core.records import ErrorInfo, JobOptions
from ..core.wire import DeviceView, Finished, Hello, LogLines, Outcome, ProcessSpec, Rank, Report, RunJob, RunPack
from .channel import Channel
from .command import CommandJob
from .command_process import become_subreaper
from .oom import MiB, release_memory, run_guarded, settle_device, warm_cublas
from .progress import ProgressThrottle
from .rank import run_command_rank, run_rank
from .registry import JobRegistry, validate_kwargs
from .scalars import ScalarLog, run_dir

logger = logging.getLogger(__name__)

#: Words in a job's error that mean CUDA's context may be unusable for the rest of the process
#: (a device-side assert, an illegal memory access: there is no reset, pytorch#2300).
CUDA_POISON_MARKERS = ("cuda error", "device-side assert", "illegal memory access", "cublas_status",
                       "cudnn_status", "unspecified launch failure")


def rss_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``: no psutil import on the hot path)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def gpu_memory_in_use() -> int | None:
    """Bytes the CUDA caching allocator holds on this process's GPU, or None without CUDA."""
    torch = sys.modules.get("torch")
    # is_initialized first: a flag, where is_available asks the driver (after every job).
    if torch is None or not torch.cuda.is_initialized() or not torch.cuda.is_available():
        return None
    return int(torch.cuda.memory_reserved())


def cap_allocator(limit_bytes: int) -> None:
    """Cap CUDA's caching allocator of this process at ``limit_bytes``: an allocation past it
    raises torch's out-of-memory error (the job's ``OutOfMemory`` entry) before the process
    takes device memory its slot's neighbours need. A no-op without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(0.0, limit_bytes / total)), 0)


def poisons_cuda(exc: BaseException) -> bool:
    """Whether ``exc`` says CUDA failed in a way that may have poisoned this process's context."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return type(exc).__name__ == "AcceleratorError" or any(marker in text for marker in CUDA_POISON_MARKERS)


@dataclass
class _Baseline:
    """What every job starts from."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    cores: list[int]
    threads: int


@dataclass
class JobRuntime:
    """One job process's jobs and the state each of them starts from."""

    spec: ProcessSpec
    registry: JobRegistry
    visibility: DeviceView
    baseline: _Baseline
    #: Why this process runs no more jobs, found after a job had ended (a CUDA error that showed
    #: only when a pack's memory was released): each job it is sent goes back (:meth:`hand_back`).
    broken: str | None = None

    @classmethod
    def prepare(cls, spec: ProcessSpec, channel: Channel) -> JobRuntime:
        """Pin the cores, load torch and the jobs, check the device; a command's output lines
        go to the worker over ``channel``.

        Raises:
            ConfigError: a job module cannot be imported.
            DeviceVisibilityError: the device is not visible as it should be.
            NoJobAccount: it runs as a user's account (``spec.account``) yet holds a capability.
        """
        if spec.account is not None:
            check_no_capabilities(spec.account)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, spec.cores)
        import torch

        torch.set_num_threads(spec.torch_threads)
        registry = JobRegistry(spec.job_modules)
        seen = check_visibility(Device.parse(spec.device))
        seen["torch_threads"] = spec.torch_threads
        if spec.torch_device.startswith("cuda"):
            warm_cuda(spec.torch_device)
        baseline = _Baseline(environ=dict(os.environ), cwd=os.getcwd(), sys_path=list(sys.path),
                             cores=list(spec.cores), threads=spec.torch_threads)
        runtime = cls(spec=spec, registry=registry, visibility=DeviceView.model_validate(seen), baseline=baseline)
        if spec.commands is not None and spec.commands.programs:
            # What a command leaves behind is re-parented here, and ended with the command.
            become_subreaper()
            command = CommandJob(spec, spec.commands, baseline.environ,
                                 publish=lambda batch: channel.send(LogLines.model_validate({"lines": batch})))
            registry.add_builtin(command.definition())
        return runtime

    def hello(self) -> Hello:
        return Hello(pid=os.getpid(), jobs=self.registry.infos(), visibility=self.visibility, rss_bytes=rss_bytes())

    def reset(self, job: RunJob | None = None) -> None:
        """Put back the environment, working directory and ``sys.path``; pin the cores and set
        the threads of ``job``'s slot (else the process's own); cap CUDA's allocator at its limit."""
        base = self.baseline
        if os.environ != base.environ:
            os.environ.clear()
            os.environ.update(base.environ)
        if os.getcwd() != base.cwd:
            os.chdir(base.cwd)
        if sys.path != base.sys_path:
            sys.path[:] = base.sys_path
        cores, threads = self.cores_of(job), self.threads_of(job)
        if hasattr(os, "sched_getaffinity") and sorted(os.sched_getaffinity(0)) != cores:
            os.sched_setaffinity(0, cores)
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if job is not None and job.allocator_limit_bytes is not None:
            cap_allocator(job.allocator_limit_bytes)

    def cores_of(self, job: RunJob | None) -> list[int]:
        return sorted(job.cores) if job is not None and job.cores else self.baseline.cores

    def threads_of(self, job: RunJob | None) -> int:
        return job.torch_threads if job is not None and job.torch_threads else self.baseline.threads

    def run(self, job: RunJob, channel: Channel) -> Finished:
        """Run ``job`` from the baseline state; never raises (the outcome says how it ended)."""
        self.reset(job)
        return run_job(self, job, channel)

    def hand_back(self, sent: RunJob | RunPack) -> list[Finished]:
        """What a :attr:`broken` process answers instead of running ``sent``: each job (each
        member of a pack) gives way, back to its queue with no attempt spent, and asks for the
        process's retirement, so the job runs on a fresh process, not on a broken context."""
        jobs = sent.members if isinstance(sent, RunPack) else [sent]
        return [Finished(outcome=Outcome.GIVE_WAY, rss_bytes=rss_bytes(), retire=self.broken,
                         job_id=job.job_id if isinstance(sent, RunPack) else None) for job in jobs]

    def rank_of(self, definition: JobDefinition, rank: Rank, channel: Channel) -> JobFunc:
        """The job as one rank of a distributed job (:mod:`tasks.jobproc.rank`)."""
        if isinstance(definition.func, CommandJob):
            command = definition.func

            def command_rank(ctx: JobContext, params: Any) -> dict[str, Any]:
                return run_command_rank(command, ctx, params, rank, channel)

            return command_rank
        func = definition.func

        def one_rank(ctx: JobContext, params: Any) -> dict[str, Any]:
            return run_rank(func, ctx, params, rank, channel)

        return one_rank


@dataclass
class _Ending:
    """How one job ended, gathered while it runs."""

    outcome: Outcome = Outcome.OK
    output: dict[str, Any] | None = None
    error: BaseException | None = None
    retire: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: When the job's run began in this process (its process's start and imports not counted).
    started: float = field(default_factory=time.monotonic)

    def failed(self, exc: BaseException, outcome: Outcome = Outcome.ERROR) -> None:
        # Only its type and message are kept: its traceback's frames (and any exception it was
        # raised from) would hold the job's tensors past the memory release after a cancel.
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        self.outcome, self.error = outcome, exc


def context_of(runtime: JobRuntime, job: RunJob, slot_of: RunJob, channel: Channel, throttle: ProgressThrottle,
               scalars: ScalarLog) -> JobContext:
    """``job``'s context, in the slot of ``slot_of`` (itself; a pack's first member): its own id,
    artifacts folder, progress, curves and stops."""
    spec = runtime.spec
    return JobContext(
        device=spec.device, torch_device=spec.torch_device, job_id=job.job_id,
        artifacts_dir=Path(spec.artifacts_dir) / job.job_id, cores=runtime.cores_of(slot_of),
        threads=runtime.threads_of(slot_of), slot=slot_of.slot or 0, devices=list(slot_of.devices or [spec.device]),
        reporter=throttle.report, scalar_sink=scalars.log,
        cancelled=lambda: channel.stop_requested(job.job_id),
        interruption=lambda: channel.interruption(job.job_id),
        preemption=lambda: channel.preempted(job.job_id), attempt=job.attempt,
        memory_budget_bytes=slot_of.allocator_limit_bytes,
    )


def run_job(runtime: JobRuntime, job: RunJob, channel: Channel) -> Finished:
    """Run one job: its context, its progress and curves, its out-of-memory guard; the outcome."""
    spec = runtime.spec
    throttle = ProgressThrottle(spec.device, send=lambda meta: channel.send(Report(fields=meta)))
    scalars = ScalarLog(run_dir(Path(spec.tensorboard_dir), job.job, job.fan_out_id, spec.device))
    ending = _Ending()
    try:
        definition = runtime.registry.get(job.job)
        options = JobOptions.model_validate(job.options)
        params = validate_kwargs(definition, job.kwargs)
        ctx = context_of(runtime, job, job, channel, throttle, scalars)
        func = definition.func if job.rank is None else runtime.rank_of(definition, job.rank, channel)
        output, still_held = run_guarded(func, ctx, params, options.fallback)
        if not isinstance(output, dict):
            raise JobError(f"job {definition.name!r} returned {type(output).__name__}, not a dict")
        json.dumps(output)  # results travel as JSON: fail here, in the entry, not in Celery
        ending.output, ending.metrics = output, {m.value: v for m, v in definition.metric_values(output).items()}
        if still_held:
            ending.retire = "device memory still held after an out-of-memory the job fell back from"
    except BaseException as exc:  # a job's own failure: reported, never fatal to the process
        outcome, retire = classify(spec, job.job, job.job_id, exc)
        ending.failed(exc, outcome)
        ending.retire = retire
    finally:
        throttle.flush()  # the last report always goes out: the finished bar shows 10/10
        scalars.close()
    return _finished(runtime, ending)


def warm_cuda(torch_device: str) -> None:
    """Make this process's CUDA context and load cuBLAS now, before it says hello, and give back
    what that allocated (:func:`~tasks.jobproc.oom.release_memory`). Else both come with the first
    job: the worker measures the process's device memory before it (its baseline, which the slot's
    allocator limit leaves out) without the context's, and its resident memory at hello without
    cuBLAS's, so the first job's growth would count them; and the first job waits for them."""
    warm_cublas(torch_device)
    release_memory(torch_device)  # synchronizes: the kernels are done


def classify(spec: ProcessSpec, name: str, job_id: str, exc: BaseException) -> tuple[Outcome, str | None]:
    """How a job (or a pack's member) that raised ``exc`` ended, and why its process must not
    run another (None: it may)."""
    if isinstance(exc, OutOfMemory):
        logger.warning("%s: job %s ran out of memory: %s", spec.device, name, exc)
        # The allocator's state after an out-of-memory is not worth trusting with the next job.
        return Outcome.ERROR, "out of memory" + (", device memory still held" if exc.recycle else "")
    for kind, outcome in ((JobCancelled, Outcome.CANCELLED), (Preempted, Outcome.PREEMPTED),
                          (PeerLost, Outcome.PEER_LOST)):
        if isinstance(exc, kind):
            logger.info("%s: job %s %s: %s", spec.device, name, job_id, exc)
            return outcome, None
    if isinstance(exc, DeviceFleetError):
        logger.warning("%s: job %s failed: %s", spec.device, name, exc)
        return Outcome.ERROR, None
    if isinstance(exc, Exception):
        logger.error("%s: job %s raised", spec.device, name, exc_info=exc)
        if spec.torch_device.startswith("cuda") and poisons_cuda(exc):
            return Outcome.ERROR, f"CUDA error, the context may be poisoned: {type(exc).__name__}"
        return Outcome.ERROR, None
    # sys.exit() or KeyboardInterrupt inside the job
    logger.warning("%s: job %s raised %s", spec.device, name, type(exc).__name__)
    return Outcome.ERROR, f"the job raised {type(exc).__name__}"


def _finished(runtime: JobRuntime, ending: _Ending) -> Finished:
    # Out of the except block, so the job's tensors are unreachable: the device's memory is
    # back at its baseline before the worker hears the job ended, whatever stopped it (a
    # cancel, a pruned trial, a preemption, a time limit, its worker fencing itself, its own
    # error), so the next job, or the one that preempted it, finds the memory free. What is
    # still allocated then (a module global's tensors) retires the process.
    device = settle_device(runtime.spec.torch_device, failed=ending.error is not None,
                           limit_bytes=MAX_GPU_MEMORY_LEFT_MIB * MiB)
    if device.error is not None and ending.error is None:
        # The job's own CUDA error, raised only now (kernels run asynchronously): its entry.
        logger.warning("%s: %s", runtime.spec.device, device.retire)
        ending.output, ending.metrics = None, {}
        ending.failed(device.error)
    ending.retire = ending.retire or device.retire
    exc = ending.error
    return Finished(
        outcome=ending.outcome, output=ending.output,
        error=ErrorInfo.of(exc) if exc is not None else None,
        error_module=type(exc).__module__ if exc is not None else None,
        metrics=ending.metrics, gpu_memory_bytes=device.reserved_bytes, rss_bytes=rss_bytes(),
        retire=ending.retire, run_s=time.monotonic() - ending.started,
    )


def check_no_capabilities(account: str) -> None:
    """Refuse to run user code as ``account`` with any capability or as root: the worker cleared
    them (:mod:`tasks.core.accounts`), and this checks that it did, before a job module loads.

    Raises:
        NoJobAccount: it holds one, or runs as uid 0.
    """
    held = {name: mask for name, mask in own_capabilities().items() if mask}
    if held or os.geteuid() == 0:
        raise NoJobAccount(f"the job process for account {account} holds capabilities "
                           f"{', '.join(f'{k}={v:#x}' for k, v in held.items()) or 'of root'} (uid {os.geteuid()}): "
                           "it refuses to run user code so")
