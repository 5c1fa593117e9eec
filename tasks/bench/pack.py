"""Packed trials: the reference figures a packed sweep is judged against, in one plain process.

The trials are the ``slots`` section's small ``train`` trials (the MLP on digits; 5 epochs on a
GPU, 2 on a CPU, 1 in ``--quick``), N of them: 256 on a GPU, 32 on a CPU, 8 in ``--quick``.

- ``plain_trials_per_s``: the trials run one at a time in a plain loop (``train`` called
  directly, ``torch.set_num_threads(1)``: one core), over the first few of them
  (``plain_trials``): the rate today's one-slot fleet is compared with;
- ``packed_trials_per_s``: all N trained as one vmapped model (:mod:`tasks.jobproc.packed`),
  model building and data included;
- ``packed_vs_plain``: the one over the other;
- ``accuracy_gap``: the largest difference of a trial's accuracy packed and alone, over the
  trials the plain loop ran (the issue asks for <= 0.01); ``accuracy_mean``: the packed mean;
- ``plain_loop_trials_per_s``: the same trial as the shortest honest loop a user would write in
  one process on one core (:func:`plain_loop`: the data already in memory, the MLP built, Adam,
  the epochs' batches by index, the test accuracy), without ``train``'s checkpoint, curve and
  report: the rate the fleet's per-trial overhead is judged against.

With a fleet (:func:`measure_fleet`, on the device the bench trains on: ``gpu0``, else ``cpu0``
pinned to one core with one slot), the same trials through a sweep:
``fleet_trials_per_s`` one at a time (unpacked), ``fleet_packed_trials_per_s`` with
``pack=<all of them>``; ``fleet_vs_plain_loop`` is the better of the two over
``plain_loop_trials_per_s`` (the issue's CPU goal: >= 0.5), ``fleet_packed_vs_one_slot`` the
packed rate over the unpacked one (its GPU goal: >= 50) and ``fleet_packed_vs_vmapped`` the
packed sweep over ``packed_trials_per_s`` (its GPU goal: >= 0.5).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from celery import Celery

from ..core.job import JobContext
from ..core.records import Entry
from ..core.settings import Settings
from ..jobproc.packed import Member, train_pack
from ..jobs import data
from ..jobs.models import build
from ..jobs.train import TRAIN_PACKING, TrainParams, train
from ..ops.fleet import Fleet
from ..producer.sweep import sweep
from .slots import _trials

logger = logging.getLogger(__name__)


def _context(device: str, torch_device: str, folder: Path, name: str) -> JobContext:
    return JobContext(device=device, torch_device=torch_device, job_id=name, artifacts_dir=folder / name, threads=1)


def measure(*, quick: bool) -> dict[str, Any]:
    """The plain loop's and the packed model's rates and accuracies of the same trials."""
    gpu = torch.cuda.is_available()
    device, torch_device = ("gpu0", "cuda:0") if gpu else ("cpu0", "cpu")
    count = 256 if gpu else (8 if quick else 32)
    trials = _trials(count, gpu, quick)
    plain_count = 2 if quick else (16 if gpu else 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="devicefleet-bench-pack-") as tmp:
            folder = Path(tmp)
            params = [TrainParams(**trial) for trial in trials]
            train(_context(device, torch_device, folder, "warm"), params[0])  # torch, sklearn, the data warm
            started = time.perf_counter()
            alone = [train(_context(device, torch_device, folder, f"alone{i}"), p)
                     for i, p in enumerate(params[:plain_count])]
            plain_s = time.perf_counter() - started
            def on_end(index: int, output: dict[str, Any] | None, error: BaseException | None) -> None:
                raise RuntimeError(f"pack bench: trial {index} failed: {error!r}")

            if gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            members = [Member(_context(device, torch_device, folder, f"packed{i}"), p, TRAIN_PACKING.data(p))
                       for i, p in enumerate(params)]
            ends = train_pack(TRAIN_PACKING, members, torch_device, on_end)
            packed_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    plain_rate, packed_rate = plain_count / plain_s, count / packed_s
    gap = max(abs(ends[i]["accuracy"] - alone[i]["accuracy"]) for i in range(plain_count))
    logger.info("pack: plain %.2f trials/s, packed %.2f trials/s (%d trials), accuracy gap %.4f",
                plain_rate, packed_rate, count, gap)
    return {
        "device": device, "trials": count, "plain_trials": plain_count, "epochs": trials[0]["epochs"],
        "plain_trials_per_s": plain_rate, "packed_trials_per_s": packed_rate, "packed_vs_plain": packed_rate / plain_rate,
        "accuracy_gap": gap, "accuracy_mean": sum(e["accuracy"] for e in ends.values()) / count,
    }


def fleet_rate(app: Celery, device: str, trials: list[dict[str, Any]], pack: int | str | None = None) -> float:
    """Trials per second of ``trials`` through one sweep on ``device`` of a running fleet
    (packed ``pack`` at a time, or one at a time)."""
    started = time.perf_counter()
    handle = sweep("train", trials, device, name=None, app=app, pack=pack)
    entries = handle.get(timeout=3600)
    elapsed = time.perf_counter() - started
    bad = [e for e in entries if not Entry.parse(e).ok]
    if bad:
        raise RuntimeError(f"pack bench: {len(bad)} of {len(trials)} trials failed: {bad[0]['error']}")
    if pack is not None and not handle.packing.packed:
        raise RuntimeError(f"pack bench: the sweep did not pack: {handle.packing.reason}")
    return len(trials) / elapsed


def plain_loop(trial: dict[str, Any], torch_device: str) -> float:
    """One trial (the MLP on digits) as a plain loop on ``torch_device``: build, train, score;
    returns its test accuracy. The data are loaded (and on the device) before."""
    params = TrainParams(**trial)
    split = data.load(params.dataset, test_fraction=params.test_fraction, seed=params.seed)
    x, y = split.x_train.to(torch_device), split.y_train.to(torch_device)
    torch.manual_seed(params.seed)
    net = build(params.model, split.features, split.classes, params.hidden).to(torch_device)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator(device=torch_device).manual_seed(params.seed)
    for _ in range(params.epochs):
        order = torch.randperm(len(y), device=torch_device, generator=generator)
        for start in range(0, len(y), params.batch_size):
            index = order[start:start + params.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(net(x[index]), y[index]).backward()
            optimizer.step()
    with torch.inference_mode():
        predicted = net(split.x_test.to(torch_device)).argmax(dim=1)
        return float((predicted == split.y_test.to(torch_device)).float().mean())


def plain_loop_rate(trials: list[dict[str, Any]], torch_device: str) -> float:
    """Trials per second of :func:`plain_loop` over ``trials``, one after the other, after one
    warm-up (torch, scikit-learn and the data loaded)."""
    plain_loop(trials[0], torch_device)
    if torch_device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for trial in trials:
        plain_loop(trial, torch_device)
    if torch_device.startswith("cuda"):
        torch.cuda.synchronize()
    return len(trials) / (time.perf_counter() - started)


def measure_fleet(base: Settings, figures: dict[str, Any], *, quick: bool) -> dict[str, Any]:
    """The fleet's rates of the same trials (see the module's docstring), beside ``figures``
    (:func:`measure`'s); returns them merged."""
    gpu = torch.cuda.is_available()
    device = "gpu0" if gpu else "cpu0"
    count = 256 if gpu else (8 if quick else 32)
    trials = _trials(count, gpu, quick)
    alone = trials[: (4 if quick else 16)]
    out = dict(figures)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out["plain_loop_trials_per_s"] = plain_loop_rate(alone, "cuda:0" if gpu else "cpu")
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="devicefleet-bench-pack-fleet-") as tmp:
        settings = base.model_copy(update={"redis_url": None, "state_dir": Path(tmp) / "state"})
        # On a CPU host, one device on one core with one slot: the one-core figure.
        one_core = {} if gpu else {"DEVICEFLEET_CORES": "0"}
        with Fleet(settings, cpu_workers=1, gpus=1 if gpu else 0, stop_timeout=30, metrics=False,
                   extra_env=one_core).start() as fleet:
            app = fleet.app()
            fleet_rate(app, device, trials[:2])  # the job process warm: torch, scikit-learn, the data
            out["fleet_trials_per_s"] = fleet_rate(app, device, alone)
            out["fleet_packed_trials_per_s"] = fleet_rate(app, device, trials, pack=count)
    best = max(out["fleet_trials_per_s"], out["fleet_packed_trials_per_s"])
    out["fleet_vs_plain_loop"] = best / out["plain_loop_trials_per_s"]
    out["fleet_packed_vs_one_slot"] = out["fleet_packed_trials_per_s"] / out["fleet_trials_per_s"]
    out["fleet_packed_vs_vmapped"] = out["fleet_packed_trials_per_s"] / out["packed_trials_per_s"]
    logger.info("pack: plain loop %.2f trials/s; fleet %.2f alone, %.2f packed (%.2fx the plain loop)",
                out["plain_loop_trials_per_s"], out["fleet_trials_per_s"], out["fleet_packed_trials_per_s"],
                out["fleet_vs_plain_loop"])
    return out
