"""A rank of a distributed job, in its job process: its process group, the user's code, its outcome.

The worker's gang (:mod:`tasks.worker.gang`) owns everything a gang decides: membership,
generations, wait-die and the restart budget, in Redis. It sends the job process a
:class:`~tasks.core.wire.Rank` (rank, world size, generation, rank 0's address) with the job,
as torchrun's elastic agent hands its workers their variables; this module only:

1. opens the gang's ``TCPStore``: rank 0 on a port the OS picks (no free-port race), which it
   announces over the pipe (:class:`~tasks.core.wire.StoreOpened`; the worker publishes it),
   every other rank connects to the one its :class:`~tasks.core.wire.Rank` names;
2. for a ``@job``, calls ``init_process_group`` (after :func:`import_before_any_group`) with the gang's backend and
   ``timeout=collective_timeout_s`` (not torch's 30 minutes), sets ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as torchrun sets them, runs the job with
   ``ctx.distributed``, and destroys the group on every exit path (no rank holds a group across
   jobs); for a command, runs it with torchrun's variables (:func:`run_command_rank`);
3. says how it ended: a lost peer (:func:`peer_lost`, the one rule for both) is
   :class:`~tasks.core.errors.PeerLost` (outcome ``peer_lost``: the worker's gang runs the rank
   again in its next generation); a job's own error is reported before the group goes
   (:class:`~tasks.core.wire.RankFailed`), so the peers that lose their collective to it find
   the gang failed with its reason, not restarted.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..core.defaults import STORE_POLL_S
from ..core.errors import CommandFailed, PeerLost, Preempted
from ..core.job import DistributedInfo, JobContext
from ..core.wire import Rank, RankFailed, StoreOpened
from .command import stop_error

if TYPE_CHECKING:
    from .channel import Channel
    from .command import CommandJob

logger = logging.getLogger(__name__)

#: The torch.distributed environment of torchrun, set while a rank's job runs.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Words that mean a collective lost a peer (the gang restarts), where any other failure fails
#: the gang: gloo's and NCCL's own words, in a ``@job``'s RuntimeError or a command's last
#: lines. gloo's transport errors (a reset connection, a peer that stopped answering within the
#: collective timeout) name their source, ``gloo/transport``; not any "socket" or "timed out".
PEER_LOST_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "gloo/transport",
                     "ncclremoteerror", "remote process exited", "nccl communicator was aborted")
#: The key of a generation's store that each rank of a distributed command adds 1 to once its
#: command has ended: rank 0's job process, which hosts the store, keeps it until it reaches the
#: world size.
ENDED_KEY = "devicefleet/ranks-ended"
#: Environment variables a distributed command finds besides torchrun's.
ENV_LOCAL_RANK = "DEVICEFLEET_LOCAL_RANK"
ENV_BACKEND = "DEVICEFLEET_DIST_BACKEND"


def lost_peer_text(text: str) -> bool:
    """Whether ``text`` (an error's message, a command's last lines) says a collective lost a peer."""
    lowered = text.lower()
    return any(marker in lowered for marker in PEER_LOST_MARKERS)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective lost a peer (the gang restarts), not that the job
    itself failed (the gang fails): torch's distributed errors, :class:`PeerLost`, a
    RuntimeError in gloo's or NCCL's words, a command whose last lines say so."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistError, PeerLost)):
        return True
    if isinstance(exc, CommandFailed):
        tail = exc.command.get("tail")
        return isinstance(tail, list) and lost_peer_text("\n".join(map(str, tail)))
    return isinstance(exc, RuntimeError) and lost_peer_text(str(exc))


@contextmanager
def gang_store(rank: Rank, announce: Callable[[int], None]) -> Iterator[tuple[str, int, Any]]:
    """The gang's ``TCPStore`` for this generation: ``(address, port, store)``. Rank 0 opens it
    and ``announce``\\ s its port; the others connect to it."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=rank.collective_timeout_s)
    if rank.master_port is None:
        store = dist.TCPStore(rank.master_addr, 0, world_size=rank.world_size, is_master=True,
                              wait_for_workers=False, timeout=timeout)
        announce(int(store.port))
    else:
        store = dist.TCPStore(rank.master_addr, rank.master_port, world_size=rank.world_size, is_master=False,
                              timeout=timeout)
    try:
        yield rank.master_addr, int(store.port), store
    finally:
        del store


@contextmanager
def torchrun_env(info: DistributedInfo) -> Iterator[None]:
    """Set torchrun's variables while a rank's job runs (a process runs one job at a time)."""
    saved = {name: os.environ.get(name) for name in TORCHRUN_ENV}
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.local_rank), MASTER_ADDR=info.master_addr,
                      MASTER_PORT=str(info.master_port))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def import_before_any_group() -> None:
    """Import ``torch.distributed.nn`` before this process's first process group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated when the module is
    first imported. ``DistributedDataParallel``'s constructor imports it (through
    ``torch._dynamo``), so in a process whose group already exists it keeps that group in ten
    defaults for the rest of the process: ``destroy_process_group`` then leaves the group, its
    gloo threads and its connections to the peers alive until the interpreter exits, where a
    gloo thread that still frees a tensor needs the GIL, is ended by Python's finalization and
    aborts the process (``terminate called without an active exception``, SIGABRT; issue 51).
    Imported first, the defaults hold ``None`` (what ``group.WORLD`` is before any group), and
    ``destroy_process_group`` ends the group's threads. About 6 ms (torch 2.13)."""
    import torch.distributed.nn  # noqa: F401


def _lost(rank: Rank, ctx: JobContext, exc: BaseException) -> PeerLost:
    return PeerLost(f"rank {rank.rank} of {rank.gang_id} on {ctx.device} lost a peer in generation "
                    f"{rank.generation}: {type(exc).__name__}: {exc}")


def run_rank(func: Callable[[JobContext, Any], dict[str, Any]], ctx: JobContext, params: Any, rank: Rank,
             channel: Channel) -> dict[str, Any]:
    """Run one rank of a ``@job`` in generation ``rank.generation``. The output gains ``rank``,
    ``world_size``, ``backend`` and ``restarts``.

    Raises:
        PeerLost: a collective (or the group's setup) lost a peer.
        Exception: this rank's job raised (the worker has failed the gang with it).
    """
    import torch.distributed as dist

    import_before_any_group()
    announce = _announcer(channel)
    try:
        with gang_store(rank, announce) as (master_addr, master_port, store):
            dist.init_process_group(rank.backend, store=store, rank=rank.rank, world_size=rank.world_size,
                                    timeout=datetime.timedelta(seconds=rank.collective_timeout_s))
            info = DistributedInfo(rank=rank.rank, world_size=rank.world_size, local_rank=rank.local_rank,
                                   backend=rank.backend, restarts=rank.generation, master_addr=master_addr,
                                   master_port=master_port)
            logger.info("%s: rank %d of %d (%s) of %s, generation %d", ctx.device, rank.rank, rank.world_size,
                        rank.backend, rank.gang_id, rank.generation)
            try:
                with torchrun_env(info):
                    output = func(dataclasses.replace(ctx, distributed=info), params)
            except Exception as exc:
                if not peer_lost(exc) and not isinstance(exc, Preempted):
                    # Before the group goes: the peers that see it go find the gang failed (a
                    # preempted gang's ranks all stop and go back to their queues: no failure).
                    channel.ask(RankFailed(reason=f"rank {rank.rank} on {ctx.device} failed: "
                                                  f"{type(exc).__name__}: {exc}"))
                raise
            finally:
                dist.destroy_process_group()
    except Exception as exc:
        if peer_lost(exc) and not isinstance(exc, PeerLost):
            raise _lost(rank, ctx, exc) from None
        raise
    return {**output, "rank": rank.rank, "world_size": rank.world_size, "backend": rank.backend,
            "restarts": rank.generation}


def run_command_rank(command: CommandJob, ctx: JobContext, params: Any, rank: Rank,
                     channel: Channel) -> dict[str, Any]:
    """One rank of a distributed command in generation ``rank.generation``: host (rank 0) or
    find the gang's store, run the command with torchrun's variables.

    The command finds the store with ``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun: rank
    0's job process hosts it, so no port is picked and raced for. Each worker sees only its own
    device, as ``cuda:0``: ``LOCAL_RANK`` is 0 and ``LOCAL_WORLD_SIZE`` 1, so
    ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` picks it
    (``DEVICEFLEET_LOCAL_RANK`` is the rank's index among the gang's ranks on its host). A gang
    that fails or moves on while the command runs is the worker's stop (``gang``): the command
    is ended, and the rank ends as :class:`PeerLost`.

    Raises:
        PeerLost: the command's collective lost a peer, or its gang moved on.
        CommandFailed: this rank's command failed (the worker fails the gang with it).
    """
    with gang_store(rank, _announcer(channel)) as (master_addr, master_port, store):
        env = {"RANK": str(rank.rank), "WORLD_SIZE": str(rank.world_size), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank.rank), "MASTER_ADDR": master_addr,
               "MASTER_PORT": str(master_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": str(rank.generation), "TORCHELASTIC_RUN_ID": rank.gang_id,
               "TORCHELASTIC_MAX_RESTARTS": str(rank.max_restarts), ENV_BACKEND: rank.backend,
               ENV_LOCAL_RANK: str(rank.local_rank)}
        logger.info("%s: rank %d of %d of %s (command), generation %d", ctx.device, rank.rank,
                    rank.world_size, rank.gang_id, rank.generation)
        try:
            output = command.run(ctx, params, extra_env=env)
        except CommandFailed as exc:
            _count_end(store, rank, ctx)
            if peer_lost(exc):
                raise _lost(rank, ctx, exc) from None
            raise
        _count_end(store, rank, ctx)
        if rank.master_port is None:
            _keep_store_until_every_rank_ended(store, rank, ctx)
    return {**output, "rank": rank.rank, "world_size": rank.world_size, "restarts": rank.generation}


def _count_end(store: Any, rank: Rank, ctx: JobContext) -> None:
    """Count this rank's command as ended in the gang's store (rank 0 keeps it until all are)."""
    try:
        store.add(ENDED_KEY, 1)
    except Exception as exc:  # noqa: BLE001  (rank 0's store is gone: it is not waiting for us)
        logger.info("%s: rank %d of %s could not count its end in the gang's store: %s", ctx.device, rank.rank,
                    rank.gang_id, exc)


def _keep_store_until_every_rank_ended(store: Any, rank: Rank, ctx: JobContext) -> None:
    """Rank 0 hosts the gang's store, which the other ranks' commands may still need after its
    own command ended (a slower rank's last barrier, its ``destroy_process_group``), as
    torchrun's agent keeps its store until every worker has exited: wait until every rank has
    counted its end (:data:`ENDED_KEY`), the worker stops this run (its gang moved on or failed:
    a lost rank never counts), or ``collective_timeout_s`` has passed.

    Raises:
        DeviceFleetError: the worker stopped the run (the error its stop asks for).
    """
    deadline = time.monotonic() + rank.collective_timeout_s
    while int(store.add(ENDED_KEY, 0)) < rank.world_size:
        if (stop := stop_error(ctx)) is not None:
            raise stop
        if time.monotonic() > deadline:
            logger.warning("%s: rank 0 of %s: not every rank ended within %g s of its own end; closing the "
                           "gang's store", ctx.device, rank.gang_id, rank.collective_timeout_s)
            return
        time.sleep(STORE_POLL_S)


def _announcer(channel: Channel) -> Callable[[int], None]:
    return lambda port: channel.send(StoreOpened(port=port))
