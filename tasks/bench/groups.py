"""Device groups: the ``hogwild`` job over two cores against the same training in one process
on one core (same data, epochs and seed).

The job runs here, in this process, pinned to the cores a ``cpu0+cpu1`` group's job process
would be pinned to: the union of two devices' cores (one core each on a 2-core host). The
figures: the training phase's speed-up (from every process ready to the last one done); the same
in CPU time (the one process's training against the busiest Hogwild process's: what the host's
other load moves least, as it leaves out the waits for a core); the job's wall-time speed-up
(the spawned processes' imports included); and the accuracy gap. A full run interleaves three
rounds of each (one process first, then Hogwild first, ...) and takes the median of each time,
each round's ratio beside it: the host's other load moves the figures.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..core.devices import usable_cores
from ..core.job import JobContext
from ..jobs.hogwild import HogwildParams, hogwild

logger = logging.getLogger(__name__)

#: Rounds of each run in a full run (one in ``--quick``).
ROUNDS = 3
#: The training both runs do: enough epochs for the training phase to outweigh the spawn (full
#: run), or a token run that only proves the section works (``--quick``, CI's smoke mode).
FULL = {"epochs": 60, "hidden": 256, "seed": 0}
QUICK = {"epochs": 2, "hidden": 32, "seed": 0}


@contextmanager
def _pinned(cores: list[int]) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _run(cores: list[int], processes: int, kwargs: dict[str, Any], folder: Path) -> dict[str, Any]:
    device = "+".join(f"cpu{i}" for i in range(len(cores)))
    ctx = JobContext(device=device, torch_device="cpu", job_id=f"bench-hogwild-{processes}",
                     artifacts_dir=folder, cores=cores, threads=len(cores))
    with _pinned(cores):
        return hogwild(ctx, HogwildParams(**kwargs, processes=processes))


def measure(*, quick: bool = False) -> dict[str, Any] | None:
    """The figures, or None on a host with fewer than two usable cores."""
    cores = usable_cores()
    if len(cores) < 2:
        logger.warning("groups: %d usable core(s); the Hogwild figures need two", len(cores))
        return None
    kwargs = QUICK if quick else FULL
    alone: list[dict[str, Any]] = []
    shared: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-groups-") as tmp:
        if not quick:  # this process's first training runs slower (torch's first calls): not a round
            _run(cores[:1], 1, {**kwargs, "epochs": 1}, Path(tmp))
        for round_ in range(1 if quick else ROUNDS):
            runs = [(alone, cores[:1], 1), (shared, cores[:2], 2)]
            for results, pinned, processes in runs[::-1] if round_ % 2 else runs:
                results.append(_run(pinned, processes, kwargs, Path(tmp)))

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(run[key] for run in runs))

    def slowest_cpu(runs: list[dict[str, Any]]) -> float:  # the process that finished the training
        return float(statistics.median(max(run["train_cpu_s"]) for run in runs))

    last = shared[-1]
    return {
        "hogwild_speedup": median(alone, "train_s") / median(shared, "train_s"),
        "hogwild_speedup_rounds": [a["train_s"] / b["train_s"] for a, b in zip(alone, shared, strict=True)],
        "hogwild_cpu_speedup": slowest_cpu(alone) / slowest_cpu(shared),
        "hogwild_wall_speedup": median(alone, "wall_s") / median(shared, "wall_s"),
        "hogwild_accuracy_gap": max(abs(a["accuracy"] - b["accuracy"]) for a, b in zip(alone, shared, strict=True)),
        "hogwild_accuracy": median(shared, "accuracy"),
        "one_process_accuracy": median(alone, "accuracy"),
        "hogwild_train_s": median(shared, "train_s"),
        "one_process_train_s": median(alone, "train_s"),
        "hogwild_start_s": median(shared, "start_s"),
        "hogwild_train_cpu_s": slowest_cpu(shared),
        "one_process_train_cpu_s": slowest_cpu(alone),
        "rounds": len(shared),
        "processes": last["processes"],
        "threads": last["threads"],
        **{key: kwargs[key] for key in ("epochs", "hidden")},
    }
