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

**A distributed command** (:func:`run_command_rank`) gets torchrun's variables and re-runs with
its gang when the gang restarts.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.commands import COMMAND_JOB, CommandParams, CommandRules, resolve_command
from ..core.defaults import COMMAND_DESCENDANTS_GRACE_S, COMMAND_STOP_MARGIN_S, GANG_WATCH_INTERVAL_S
from ..core.errors import CommandFailed, GangFailed, JobCancelled
from ..core.job import JobContext, JobDefinition
from ..core.records import GangSpec
from ..core.wire import ProcessSpec
from .command_output import EventReader, LogSink, events_pipe, redis_publisher
from .command_process import CommandRun, Superseded

logger = logging.getLogger(__name__)

#: What the command finds in its environment.
ENV_ARTIFACTS = "DEVICEFLEET_ARTIFACTS_DIR"
ENV_EVENTS = "DEVICEFLEET_EVENTS"
ENV_PARAMS = "DEVICEFLEET_PARAMS"
ENV_DEVICE = "DEVICEFLEET_DEVICE"
ENV_JOB_ID = "DEVICEFLEET_JOB_ID"
ENV_LOCAL_RANK = "DEVICEFLEET_LOCAL_RANK"
ENV_BACKEND = "DEVICEFLEET_DIST_BACKEND"

#: Words in a rank's last lines that mean its collective lost a peer (the gang restarts), where
#: any other failure fails the gang: gloo's and NCCL's own words, not any "socket" or "timed out".
PEER_LOST_LINES = ("connection reset by peer", "connection closed by peer", "broken pipe",
                   "ncclremoteerror", "remote process exited", "nccl communicator was aborted")



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
        ENV_JOB_ID: ctx.job_id, ENV_PARAMS: json.dumps(params.params),
    })
    env["CUDA_VISIBLE_DEVICES"] = base.get("CUDA_VISIBLE_DEVICES", "-1")
    return env


class CommandJob:
    """The built-in job :data:`COMMAND_JOB` of a job process whose worker allows commands."""

    def __init__(self, spec: ProcessSpec, rules: CommandRules, redis: Callable[[], Any],
                 base_env: dict[str, str]) -> None:
        self.spec = spec
        self.rules = rules
        self.redis = redis
        self.base_env = base_env

    def definition(self) -> JobDefinition:
        return JobDefinition(name=COMMAND_JOB, func=self, params=CommandParams, module=__name__)

    def __call__(self, ctx: JobContext, params: CommandParams) -> dict[str, Any]:
        """Run the command once; its output, or raise how it failed."""
        return self.run(ctx, params, extra_env={}, watch=lambda: False)

    def run(self, ctx: JobContext, params: CommandParams, extra_env: dict[str, str],
            watch: Callable[[], bool]) -> dict[str, Any]:
        """Raises:
            CommandRefused: the program or the folder is not allowed.
            CommandFailed: it exited non-zero or was killed by a signal.
            JobCancelled, JobTimeout, WorkerStopped: the fleet stopped it.
        """
        argv, cwd = resolve_command(params, self.spec.device, self.rules)
        ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
        client = self.redis()
        publish = redis_publisher(client, ctx.job_id, self.spec.result_expires_s) if client is not None else None
        events = EventReader(ctx)
        with events_pipe() as (events_path, events_fd):
            env = {**command_environment(self.base_env, self.spec, ctx, params, events_path), **extra_env}
            run = CommandRun(argv=argv, cwd=cwd, env=env, sink=LogSink(ctx.artifacts_dir, publish),
                             events=events, events_fd=events_fd, grace_s=max(COMMAND_DESCENDANTS_GRACE_S, self.spec.cancel_grace_s - COMMAND_STOP_MARGIN_S),
                             should_stop=lambda: _stop_error(ctx), watch=watch)
            logger.info("%s: running %s in %s", self.spec.device, " ".join(argv), cwd)
            try:
                ended = run.wait()
            except OSError as exc:  # not executable, a bad interpreter line
                raise CommandFailed(f"{argv[0]} could not be started on {self.spec.device}: {exc}",
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


def _stop_error(ctx: JobContext) -> BaseException | None:
    if ctx.cancelled is None or not ctx.cancelled():
        return None
    if ctx.interruption is not None:
        return ctx.interruption()
    return JobCancelled(f"job {ctx.job_id} on {ctx.device} was cancelled")


def _signal_name(signum: int | None) -> str | None:
    return signal.Signals(signum).name if signum is not None else None


# -- a distributed command ------------------------------------------------------------------------


def run_command_rank(job: CommandJob, ctx: JobContext, params: CommandParams, rdv: Any,
                     address: str) -> dict[str, Any]:
    """One rank of a distributed command: join the gang, host (rank 0) or find its store, run
    the command with torchrun's variables; run it again in the next generation when the gang
    restarts (a peer died, or its collective lost a peer).

    The command finds the store with ``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun: rank
    0's job process hosts it, so no port is picked and raced for. Each worker sees only its own
    device, as ``cuda:0``: ``LOCAL_RANK`` is 0 and ``LOCAL_WORLD_SIZE`` 1, so
    ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` picks it
    (``DEVICEFLEET_LOCAL_RANK`` is the rank's index among the gang's ranks on its host).

    Raises:
        GangFailed: the gang failed (a rank failed, did not come, or no restarts were left).
        CommandFailed: this rank's command failed (the gang fails with it).
    """
    try:
        return _run_command_rank(job, ctx, params, rdv, address)
    except GangFailed as exc:
        stopped = _stop_error(ctx)
        if stopped is not None:  # every rank of a cancelled job is revoked: it says cancelled
            raise stopped from exc
        raise


def _run_command_rank(job: CommandJob, ctx: JobContext, params: CommandParams, rdv: Any,
                      address: str) -> dict[str, Any]:
    spec: GangSpec = rdv.spec
    gen = rdv.join()
    while True:
        if ctx.cancelled is not None and ctx.cancelled():
            rdv.fail(f"rank {rdv.rank} on {rdv.device} was cancelled")
            raise _stop_error(ctx) or JobCancelled("cancelled")
        assembled = rdv.wait(gen)
        gen = assembled.generation
        address_, port, store = rdv.master(gen, address)
        same_host = [r for r in sorted(assembled.hosts) if assembled.hosts[r] == rdv.host]
        env = {"RANK": str(rdv.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rdv.rank), "MASTER_ADDR": address_,
               "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": str(gen), "TORCHELASTIC_RUN_ID": spec.id,
               "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts), ENV_BACKEND: spec.backend,
               ENV_LOCAL_RANK: str(same_host.index(rdv.rank) if rdv.rank in same_host else 0)}
        watch = _GangWatch(rdv, gen)
        logger.info("%s: rank %d of %d of %s (command), generation %d", rdv.device, rdv.rank,
                    spec.world_size, spec.id, gen)
        try:
            output = job.run(ctx, params, extra_env=env, watch=watch)
        except Superseded:
            if watch.failed is not None:
                raise GangFailed(f"distributed job {spec.id}: {watch.failed}") from None
            gen = rdv.join()  # the gang moved on: follow it
            continue
        except CommandFailed as exc:
            if watch.failed is not None:
                raise GangFailed(f"distributed job {spec.id}: {watch.failed}") from None
            moved = watch.moved_on()
            tail = exc.command.get("tail")
            text = "\n".join(map(str, tail)).lower() if isinstance(tail, list) else ""
            if moved or any(marker in text for marker in PEER_LOST_LINES):
                logger.warning("%s: rank %d of %s lost a peer in generation %d; restarting with the gang",
                               rdv.device, rdv.rank, spec.id, gen)
                gen = rdv.join() if moved else rdv.join(after=gen)
                continue
            rdv.fail(f"rank {rdv.rank} on {rdv.device} failed: {exc}")
            raise
        except Exception as exc:  # refused, stopped (cancel, time limit, the worker's stop)
            rdv.fail(f"rank {rdv.rank} on {rdv.device} ended: {type(exc).__name__}: {exc}")
            raise
        finally:
            del store
        return {**output, "rank": rdv.rank, "world_size": spec.world_size, "restarts": gen}


class _GangWatch:
    """Looks at the gang while a rank's command runs (a few times a second): True once it has
    failed or moved to another generation, so the command is stopped."""


    def __init__(self, rdv: Any, gen: int) -> None:
        self.rdv = rdv
        self.gen = gen
        self.failed: str | None = None
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + GANG_WATCH_INTERVAL_S
        failed, current = self.rdv.client.hmget(self.rdv.key, ["failed", "gen"])
        if failed:
            self.failed = failed.decode() if isinstance(failed, bytes) else str(failed)
            return True
        return current is not None and int(current) != self.gen

    def moved_on(self) -> bool:
        current = self.rdv.client.hget(self.rdv.key, "gen")
        return current is not None and int(current) != self.gen
