"""The data loader's hand-off (tasks/jobs/handoff.py): batches from worker processes arrive whole,
as shared memory the loop maps without waiting on the worker that made them."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_convert

from tasks.jobs import handoff
from tasks.jobs.loader import build_loader

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not handoff.supported(), reason="no descriptor passing on this platform")]

Pair = namedtuple("Pair", "left right")


class Whole(Dataset[Any]):
    """Whole batches of every shape a collate function passes through."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> Any:
        grid = torch.arange(12, dtype=torch.float64).reshape(3, 4) + index
        return {"t": grid.t(),  # not contiguous
                "pair": Pair(torch.tensor([index]), f"label{index}"),
                "list": [torch.zeros(0), torch.full((2,), index, dtype=torch.int16)],
                "n": index}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_batches_of_samples_arrive_as_without_workers_in_shared_memory() -> None:
    data = TensorDataset(torch.randn(50, 3), torch.arange(50))
    plain = list(build_loader(data, batch_size=8, num_workers=0, cuda=False))
    loader = build_loader(data, batch_size=8, num_workers=2, cuda=False)
    for _ in range(2):  # persistent workers: a second epoch goes through the same hand-off
        got = list(loader)
        assert _same(got, plain)
        assert all(t.is_shared() for batch in got for t in batch)


def test_whole_batches_keep_their_structure_layout_and_values() -> None:
    plain = list(build_loader(Whole(), batch_size=None, num_workers=0, cuda=False))
    got = list(build_loader(Whole(), batch_size=None, num_workers=2, cuda=False))
    assert _same(got, plain)
    assert got[0]["t"].shape == (4, 3) and isinstance(got[0]["pair"], Pair)


def test_a_loop_that_stops_early_leaks_no_descriptor_and_batches_outlive_the_loader() -> None:
    plain = list(build_loader(Whole(), batch_size=None, num_workers=0, cuda=False))
    loader = build_loader(Whole(), batch_size=None, num_workers=2, cuda=False)
    list(loader)  # workers and their pipes exist from here on
    gc.collect()
    before = _open_fds()  # (a live batch's tensor holds its segment's descriptor)
    iterator = iter(loader)
    first = next(iterator)
    del iterator  # the batches prefetched for it are dropped, their descriptors sent already
    again = list(loader)
    assert _same(again, plain) and _same(first, plain[0])
    del again, first
    gc.collect()
    assert _open_fds() <= before
    kept = list(loader)
    del loader
    gc.collect()
    assert _same(kept, plain)


def _make_and_stop(shared: handoff.Handoff, pipe: Any) -> None:
    batch = shared((torch.arange(6.0).reshape(2, 3), torch.tensor([7])))
    pipe.send(batch)
    os.kill(os.getpid(), signal.SIGSTOP)  # the worker makes no further move


def test_the_loop_maps_a_batch_while_its_worker_is_stopped() -> None:
    """The contract that keeps the loop from waiting: everything the loop needs is sent with the
    batch (torch's own hand-off asks the worker for each tensor's descriptor, and would hang)."""
    shared = handoff.Handoff(default_convert, keep=2)
    receiver, sender = mp.get_context("fork").Pipe(duplex=False)
    worker = mp.get_context("fork").Process(target=_make_and_stop, args=(shared, sender))
    worker.start()
    try:
        batch = receiver.recv()
        assert isinstance(batch[0], handoff.SharedTensor)
        x, y = handoff.restore(batch)
        assert torch.equal(x, torch.arange(6.0).reshape(2, 3)) and torch.equal(y, torch.tensor([7]))
    finally:
        worker.kill()
        worker.join()


def test_spawned_workers_get_the_sending_end() -> None:
    """CUDA loaders spawn their workers (a CUDA process must not fork): the hand-off travels to them."""
    data = TensorDataset(torch.arange(12.0).reshape(6, 2))
    loader = build_loader(data, batch_size=3, num_workers=1, cuda=False)
    loader.multiprocessing_context = "spawn"
    assert _same(list(loader), list(build_loader(data, batch_size=3, num_workers=0, cuda=False)))
