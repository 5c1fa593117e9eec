"""The command job: an existing program run in the job process's place, under its supervision.

:class:`CommandJob` is the built-in job ``command`` of a job process whose worker config allows
commands (``[commands]``). It checks the command against the worker's rules again (the producer
checked them first), starts it (:mod:`.command_process`) in its sandbox, reads its output and
events (:mod:`.command_output`), and turns its end into an output or an error.

**The sandbox.** The command sees its device only (``CUDA_VISIBLE_DEVICES``), its cores (the
affinity it inherits, ``OMP_NUM_THREADS``), the working directory its worker config allows, the
producer's ``env``, and none of the worker's ``DEVICEFLEET_*`` settings (the Redis URL may hold a
password) nor its import path. It gets :data:`ENV_ARTIFACTS` (a folder for its files),
:data:`ENV_EVENTS`, :data:`ENV_PARAMS`, :data:`ENV_DEVICE` and :data:`ENV_JOB_ID`.

**A distributed command** (:func:`tasks.jobproc.rank.run_command_rank`) gets torchrun's
variables; the worker's gang runs it again when the gang restarts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.commands import COMMAND_JOB, CommandParams, CommandRules, resolve_command
from ..core.defaults import COMMAND_DESCENDANTS_GRACE_S, COMMAND_STOP_MARGIN_S
from ..core.errors import CommandFailed, CommandRefused, DeviceFleetError, JobCancelled
from ..core.job import JobContext, JobDefinition
from ..core.wire import ProcessSpec
from .command_output import EventReader, LogSink, events_pipe
from .command_process import CommandRun

logger = logging.getLogger(__name__)

#: What the command finds in its environment.
ENV_ARTIFACTS = "DEVICEFLEET_ARTIFACTS_DIR"
ENV_EVENTS = "DEVICEFLEET_EVENTS"
ENV_PARAMS = "DEVICEFLEET_PARAMS"
ENV_DEVICE = "DEVICEFLEET_DEVICE"
ENV_JOB_ID = "DEVICEFLEET_JOB_ID"
#: Which run of the job this is (1 first; one more after each preemption or lost worker): a
#: command that finds ``DEVICEFLEET_ATTEMPT`` > 1 resumes from its checkpoint in its artifacts folder.
ENV_ATTEMPT = "DEVICEFLEET_ATTEMPT"



def inherited_environment(base: Mapping[str, str]) -> dict[str, str]:
    """What a command keeps of the environment it is started from: all but the fleet's own
    settings (``DEVICEFLEET_*``: the Redis URL may hold a password) and the fleet's import path."""
    return {k: v for k, v in base.items() if not k.startswith("DEVICEFLEET_") and k != "PYTHONPATH"}


def command_environment(base: dict[str, str], spec: ProcessSpec, ctx: JobContext, params: CommandParams,
                        events_path: str) -> dict[str, str]:
    """What the command's environment holds: the job process's, without the fleet's settings and
    import path, with the producer's ``env`` and the fleet's variables on top."""
    env = inherited_environment(base)
    env.update(params.env)
    env.update({
        "OMP_NUM_THREADS": str(ctx.threads or spec.torch_threads),
        "MKL_NUM_THREADS": str(ctx.threads or spec.torch_threads),
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        ENV_ARTIFACTS: str(ctx.artifacts_dir), ENV_EVENTS: events_path, ENV_DEVICE: spec.device,
        ENV_JOB_ID: ctx.job_id, ENV_PARAMS: json.dumps(params.params), ENV_ATTEMPT: str(ctx.attempt),
    })
    env["CUDA_VISIBLE_DEVICES"] = base.get("CUDA_VISIBLE_DEVICES", "-1")
    return env


class CommandJob:
    """The built-in job :data:`COMMAND_JOB` of a job process whose worker allows commands."""

    def __init__(self, spec: ProcessSpec, rules: CommandRules, base_env: dict[str, str],
                 publish: Callable[[list[list[str]]], None] | None) -> None:
        self.spec = spec
        self.rules = rules
        self.base_env = base_env
        #: Sends a batch of output lines to the worker, which streams them to the producer.
        self.publish = publish

    def definition(self) -> JobDefinition:
        return JobDefinition(name=COMMAND_JOB, func=self, params=CommandParams, module=__name__)

    def __call__(self, ctx: JobContext, params: CommandParams) -> dict[str, Any]:
        """Run the command once; its output, or raise how it failed."""
        return self.run(ctx, params, extra_env={})

    def run(self, ctx: JobContext, params: CommandParams, extra_env: dict[str, str]) -> dict[str, Any]:
        """Raises:
            CommandRefused: the program or the folder is not allowed.
            CommandFailed: it exited non-zero or was killed by a signal.
            JobCancelled, JobTimeout, WorkerStopped: the fleet stopped it.
            PeerLost: its gang failed or moved on (a rank of a distributed command).
        """
        argv, cwd = resolve_command(params, self.spec.device, self.rules)
        ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
        events = EventReader(ctx)
        with events_pipe() as (events_path, events_fd):
            env = {**command_environment(self.base_env, self.spec, ctx, params, events_path), **extra_env}
            run = CommandRun(argv=argv, cwd=cwd, env=env, sink=LogSink(ctx.artifacts_dir, self.publish),
                             events=events, events_fd=events_fd, grace_s=max(COMMAND_DESCENDANTS_GRACE_S, self.spec.cancel_grace_s - COMMAND_STOP_MARGIN_S),
                             should_stop=lambda: stop_error(ctx))
            logger.info("%s: running %s in %s", self.spec.device, " ".join(argv), cwd)
            try:
                ended = run.wait()
            except OSError as exc:  # not executable, a bad interpreter line, the folder gone since
                if not cwd.is_dir():
                    raise CommandRefused(f"working directory {cwd} does not exist on {self.spec.device}'s host "
                                         "(it went away after the command was checked): create it again") from None
                raise CommandFailed(f"{argv[0]} could not be started on {self.spec.device}: {os_error_text(exc)}",
                                    command={"argv": argv, "exit_code": None, "signal": None, "tail": [],
                                             "log": str(ctx.artifacts_dir)}) from None
        seconds = time.monotonic() - run.started
        figures: dict[str, Any] = {"argv": argv, "exit_code": ended.code, "signal": _signal_name(ended.signal),
                                   "seconds": round(seconds, 3), "lines": run.sink.lines,
                                   "log": str(ctx.artifacts_dir)}
        if events.errors:
            figures["bad_events"] = events.errors
        tail = list(run.sink.tail)
        if ended.stopped is not None:
            # Cancelled, timed out, stopped with its worker: the entry still says where it was.
            ended.stopped.command = {**figures, "tail": tail}  # type: ignore[attr-defined]
            raise ended.stopped
        if not ended.ok:
            raise CommandFailed(
                f"{' '.join(params.formatted_argv())[:200]} {ended.describe()} on {self.spec.device}; last lines:\n"
                + "\n".join(tail[-5:]), command={**figures, "tail": tail})
        return {**events.output, "command": figures}


def stop_error(ctx: JobContext) -> DeviceFleetError | None:
    """The error the worker's stop of ``ctx``'s run asks for (cancelled, past its time limit,
    its gang moved on...), or ``None`` while none is asked."""
    if ctx.cancelled is None or not ctx.cancelled():
        return None
    if ctx.interruption is not None:
        return ctx.interruption()
    return JobCancelled(f"job {ctx.job_id} on {ctx.device} was cancelled")


def os_error_text(exc: OSError) -> str:
    """An OSError as a person reads it: its reason and the file it concerns as plain text
    (``str(exc)`` shows a path as ``PosixPath('...')``)."""
    reason = exc.strerror or type(exc).__name__
    return f"{reason}: {os.fspath(exc.filename)}" if exc.filename is not None else reason


def _signal_name(signum: int | None) -> str | None:
    return signal.Signals(signum).name if signum is not None else None
