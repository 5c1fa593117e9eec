"""Distributed training: a 2-rank DDP ``train`` on the fleet against native PyTorch DDP.

- ``vs_native``: the wall time of ``fan_out("train", cpu0+cpu1, distributed=True).get()``
  divided by that of the same training launched the way PyTorch's DDP tutorial launches it,
  ``torch.multiprocessing.spawn`` with a plain ``init_process_group("gloo")`` (``env://``).
  Same job function, model, data, epochs, one torch thread and one core per rank (each rank
  pinned as the fleet's workers are); interleaved, best of three each. Like with like: the
  fleet's workers are already running, so the native time starts when all its ranks are too
  (after their imports, before ``init_process_group``) and ends when the last rank has destroyed its
  group. What a cold launch costs on top is ``native_launch_s`` (the whole ``spawn``).
- ``vs_native_train``: the same ratio for the training loop alone (``train_s`` of the slowest
  rank), without the launch: what the fleet's rendezvous and process group cost inside a job.
- ``scaling``: training samples per second of the 2-rank gang over one rank's training the
  same total work (``train`` on cpu0). On a 2-core host the two ranks also share the memory
  bus and the gloo transport runs on the same cores, so expect well under 2.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import Celery

from ..core.job import DistributedInfo, JobContext
from ..core.records import Entry
from ..jobproc.rank import import_before_any_group
from ..producer.fanout import fan_out
from .efficiency import job_epochs, mp_context, train_kwargs

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _native_rank(rank: int, world: int, port: int, kwargs: dict[str, Any], folder: str) -> None:
    """One rank of native DDP: what ``torch.multiprocessing.spawn`` runs in each process."""
    import datetime

    import torch
    import torch.distributed as dist

    from ..jobs import data
    from ..jobs.train import TrainParams, train

    params = TrainParams(**kwargs)
    # Warm as a fleet worker that has run a job is: scikit-learn imported, the dataset read once.
    data.load(params.dataset, test_fraction=params.test_fraction, seed=params.seed)
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, [cores[rank % len(cores)]])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # As a fleet rank does (and a DDP script should): else DistributedDataParallel's import of
    # torch.distributed.nn keeps the group alive past its destroy, and a rank now and then
    # aborted at its exit (SIGABRT, about 1 run of 8 here), failing the spawn after its work.
    import_before_any_group()
    ready = time.time()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        info = DistributedInfo(rank=rank, world_size=world, local_rank=rank, backend="gloo", restarts=0,
                               master_addr="127.0.0.1", master_port=port)
        ctx = JobContext(device=f"native{rank}", torch_device="cpu", job_id=f"native-{rank}",
                         artifacts_dir=Path(folder) / f"rank{rank}", cores=[rank], distributed=info)
        output = train(ctx, params)
    finally:
        dist.destroy_process_group()
    record = {"ready": ready, "done": time.time(), "output": output}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(record))


def run_native(world: int, kwargs: dict[str, Any], folder: Path, *,
               forked: bool = False) -> tuple[float, float, list[dict[str, Any]]]:
    """Native DDP launched with ``torch.multiprocessing.spawn``: ``(seconds from the last rank
    ready to the last one done, seconds of the whole spawn, each rank's train output)``.

    ``forked`` (``--quick``) forks the ranks from the fan-out section's forkserver instead
    (:func:`.efficiency.mp_context`: torch and the job's code already imported), which spares a
    smoke run two interpreters importing torch; its ``native_launch_s`` is then no cold launch."""
    import torch.multiprocessing as tmp

    folder.mkdir(parents=True, exist_ok=True)
    if forked:
        mp_context()  # its preloads, where the fan-out section has not started it
    t0 = time.perf_counter()
    tmp.start_processes(_native_rank, args=(world, _free_port(), kwargs, str(folder)), nprocs=world, join=True,
                        start_method="forkserver" if forked else "spawn")
    launch = time.perf_counter() - t0
    records = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    # From the moment every rank is ready (as a fleet's idle workers are) to the last one done.
    ran = max(r["done"] for r in records) - max(r["ready"] for r in records)
    return ran, launch, [r["output"] for r in records]


def _check(results: dict[str, dict[str, Any]], what: str) -> list[dict[str, Any]]:
    bad = {d: e["error"] for d, e in results.items() if not Entry.parse(e).ok}
    if bad:
        raise RuntimeError(f"{what} failed: {bad}")
    return [e["output"] for e in results.values()]


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any] | None:
    """``{"vs_native", "vs_native_train", "scaling", ...}`` over the first two CPU devices, or
    None with fewer than two."""
    if len(devices) < 2:
        return None
    pair = devices[:2]
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-ddp-") as tmp:
        artifacts = Path(tmp)
        epochs = job_epochs(quick, artifacts)
        kwargs = {**train_kwargs(epochs), "checkpoint_every_s": 3600.0}
        repeats = 1 if quick else 3
        if not quick:  # --quick's figures are not judged: its first gang pays the warm-up
            # Warm the workers and the gang path (imports, dataset, gloo) as the native runs are
            # warm in what they share with this process (the dataset cache on disk).
            _check(fan_out(("train", train_kwargs(1)), pair, distributed=True, app=app).get(timeout=600), "warm-up")
        fleet_wall: list[float] = []
        fleet_train: list[float] = []
        native_wall: list[float] = []
        native_launch: list[float] = []
        native_train: list[float] = []
        single_train: list[float] = []
        samples = 0
        for i in range(repeats):
            t0 = time.perf_counter()
            outs = _check(fan_out(("train", kwargs), pair, distributed=True, app=app).get(timeout=900),
                          "DDP fan-out")
            fleet_wall.append(time.perf_counter() - t0)
            fleet_train.append(max(o["train_s"] for o in outs))
            if len({o["weights_digest"] for o in outs}) != 1:
                raise RuntimeError(f"DDP ranks ended with different weights: {outs}")

            wall, launch, native_outs = run_native(len(pair), kwargs, artifacts / f"native-{i}", forked=quick)
            native_wall.append(wall)
            native_launch.append(launch)
            native_train.append(max(o["train_s"] for o in native_outs))

            single = _check(fan_out(("train", kwargs), pair[:1], app=app).get(timeout=900), "1-rank train")[0]
            single_train.append(single["train_s"])
            samples = single["samples_seen"]
    best = {name: min(values) for name, values in (
        ("fleet_s", fleet_wall), ("native_s", native_wall), ("fleet_train_s", fleet_train),
        ("native_train_s", native_train), ("one_rank_train_s", single_train),
        ("native_launch_s", native_launch))}
    out = {
        "ranks": len(pair),
        "devices": pair,
        "epochs": epochs,
        **best,
        "vs_native": best["fleet_s"] / best["native_s"],
        "vs_native_train": best["fleet_train_s"] / best["native_train_s"],
        "samples_per_s_2_ranks": samples / best["fleet_train_s"],
        "samples_per_s_1_rank": samples / best["one_rank_train_s"],
        "scaling": best["one_rank_train_s"] / best["fleet_train_s"],
        "repeats": repeats,
        "fleet_runs_s": fleet_wall,
        "native_runs_s": native_wall,
    }
    logger.info("DDP: %s", out)
    return out
