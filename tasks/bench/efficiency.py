"""Fan-out efficiency: K equal CPU-bound ``train`` jobs on K devices.

Compared with what users do instead:

- the same K jobs one after another in one process;
- the plain pattern: one ``multiprocessing.Process`` per job, outputs in a ``Manager().dict()``.

Every variant runs the ``train`` job's own function with one torch thread per job (each CPU
worker of a 2-core host owns one core), so only the way the jobs are spread differs.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery

from ..core.job import JobContext
from ..core.records import Entry
from ..producer.fanout import fan_out

logger = logging.getLogger(__name__)


def train_kwargs(epochs: int) -> dict[str, Any]:
    return {"model": "mlp", "epochs": epochs, "num_workers": 0, "batch_size": 64}


def run_train_inline(device: str, kwargs: dict[str, Any], artifacts: Path) -> dict[str, Any]:
    """Run the ``train`` job's function in this process with one torch thread; returns its output."""
    import torch

    from ..jobs.train import TrainParams, train

    torch.set_num_threads(1)
    ctx = JobContext(device=device, torch_device="cpu", job_id=f"bench-{device}",
                     artifacts_dir=artifacts / device, cores=[0])
    return train(ctx, TrainParams(**kwargs))


def _mp_child(device: str, kwargs: dict[str, Any], artifacts: str, out: Any) -> None:
    out[f"{device}_output"] = run_train_inline(device, kwargs, Path(artifacts))


def mp_context() -> Any:
    """The baseline's processes (and ``--quick``'s native DDP ranks, :mod:`.ddp`) fork from a
    forkserver that has imported the job's code and never trained. Forking this process itself
    fails once its inline runs have used autograd on a CUDA build ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing", seen on an H100 host), and spawn
    would charge the baseline an interpreter start and a torch import per job that the fleet's
    warm workers do not pay."""
    ctx = mp.get_context("forkserver")
    # What a warm worker has imported: train's lazy imports too (scikit-learn's datasets, and
    # torch._dynamo, which the first optimizer pulls in), or the baseline pays ~4 s of imports.
    ctx.set_forkserver_preload([__name__, "tasks.jobs.train", "sklearn.datasets", "torch._dynamo"])
    return ctx


def _noop() -> None:
    pass


def warm_multiprocessing() -> None:
    """Start the forkserver (and its imports) before anything is timed, as the workers are warm."""
    proc = mp_context().Process(target=_noop)
    proc.start()
    proc.join()


def run_multiprocessing(devices: list[str], kwargs: dict[str, Any], artifacts: Path) -> float:
    """Wall seconds of the plain multiprocessing pattern: a Process per job, a Manager dict, join()."""
    ctx = mp_context()
    t0 = time.perf_counter()
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_mp_child, args=(d, kwargs, str(artifacts), out)) for d in devices]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if len(out) != len(devices) or any(p.exitcode for p in procs):
            raise RuntimeError(f"multiprocessing baseline failed: exit codes {[p.exitcode for p in procs]}")
    return time.perf_counter() - t0


#: Epochs of the ``train`` jobs in ``--quick`` (CI's smoke mode): a short job, set rather than
#: calibrated, since calibrating runs the job three times in this process (1, 2 and 6 epochs).
QUICK_EPOCHS = 4


def job_epochs(quick: bool, artifacts: Path) -> int:
    """Epochs for the section's ``train`` jobs: :data:`QUICK_EPOCHS` in ``--quick``, else about
    3 s of training (:func:`calibrate_epochs`). Either way this process has run the job once
    (imports, dataset cache), as the fleet's warm workers have."""
    if not quick:
        return calibrate_epochs(3.0, artifacts)
    run_train_inline("warm", train_kwargs(1), artifacts)
    return QUICK_EPOCHS


def calibrate_epochs(target_s: float, artifacts: Path) -> int:
    """Epochs for a ``train`` job of about ``target_s`` seconds on one thread.

    Two short runs separate the per-epoch time from the fixed cost (dataset, checkpoint).
    """
    run_train_inline("calib", train_kwargs(1), artifacts)  # imports, dataset cache
    times = []
    for epochs in (2, 6):
        t0 = time.perf_counter()
        run_train_inline("calib", train_kwargs(epochs), artifacts)
        times.append(time.perf_counter() - t0)
    per_epoch = max((times[1] - times[0]) / 4, 1e-3)
    fixed = max(times[0] - 2 * per_epoch, 0.0)
    return max(1, round((target_s - fixed) / per_epoch))


def measure(app: Celery, devices: list[str], *, quick: bool) -> dict[str, Any]:
    """``{"efficiency", "vs_multiprocessing", ...}`` for K = ``len(devices)`` equal jobs."""
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-") as tmp:
        artifacts = Path(tmp)
        # The baseline's forkserver imports what it preloads on one core while this process
        # warms up (or calibrates) on another; both are done before anything is timed.
        forkserver = threading.Thread(target=warm_multiprocessing, name="bench-warm-forkserver", daemon=True)
        forkserver.start()
        try:
            epochs = job_epochs(quick, artifacts)
            # Warm the workers (imports, dataset) as the in-process runs are warm. In --quick too:
            # the warm-ups run while the forkserver starts, so they cost no wall time there.
            fan_out(("train", train_kwargs(1)), devices, app=app).get(timeout=600)
        finally:
            forkserver.join()
        repeats = 1 if quick else 3
        kwargs = train_kwargs(epochs)

        # Each variant runs `repeats` times, interleaved, and keeps its best time: on a shared
        # VM one run can lose a third of its speed to a noisy neighbour (steal time).
        single: list[float] = []
        sequential: list[float] = []
        multiprocessing: list[float] = []
        fanouts: list[float] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_train_inline("single", kwargs, artifacts)
            single.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for device in devices:
                run_train_inline(device, kwargs, artifacts)
            sequential.append(time.perf_counter() - t0)

            multiprocessing.append(run_multiprocessing(devices, kwargs, artifacts))

            t0 = time.perf_counter()
            results = fan_out(("train", kwargs), devices, app=app).get(timeout=600)
            fanouts.append(time.perf_counter() - t0)
            bad = {d: e["error"] for d, e in results.items() if not Entry.parse(e).ok}
            if bad:
                raise RuntimeError(f"train fan-out failed: {bad}")
    single_s, sequential_s, mp_s, fanout_s = (min(v) for v in (single, sequential, multiprocessing, fanouts))
    out = {
        "jobs": len(devices),
        "epochs": epochs,
        "single_s": single_s,
        "sequential_s": sequential_s,
        "multiprocessing_s": mp_s,
        "fanout_s": fanout_s,
        "efficiency": single_s / fanout_s,
        "vs_multiprocessing": fanout_s / mp_s,
        "speedup_vs_sequential": sequential_s / fanout_s,
        "repeats": repeats,
        "fanout_runs_s": fanouts,
        "multiprocessing_runs_s": multiprocessing,
    }
    logger.info("fan-out efficiency: %s", out)
    return out
