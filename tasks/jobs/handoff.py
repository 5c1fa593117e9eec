"""How a DataLoader worker hands a batch to the training loop without the loop waiting on it.

PyTorch's own hand-off (``torch.multiprocessing``'s ``file_descriptor`` strategy) copies each
tensor into a new shared-memory segment when the worker's queue thread pickles it (holding the
worker's GIL), and the loop, unpickling the batch, asks the worker for each segment's descriptor
over a socket (``multiprocessing.resource_sharer``: a connection with an HMAC handshake per
tensor, however small, answered by a thread of the worker that needs the worker's GIL and a turn
on a core). So the loop waits for a batch the worker finished long before whenever the worker is
busy or off-core: py-spy on the fed-device bench (``devicefleet bench --section pipeline``, a
loaded 2-core host) put the loop's wait half in that handshake and half in waiting for the queue
thread's copy.

Here the worker's collate function puts each tensor in shared memory itself (a torch copy, which
releases the GIL; none when the tensor is shared already, as ``default_collate``'s batches are),
sends the segment's descriptor to the loop's process at once over a socket pair (``SCM_RIGHTS``),
and returns a small :class:`SharedTensor` in the tensor's place. The loop's process finds the
descriptor waiting in its socket (it was sent before the batch) and maps it: no round trip to the
worker. A descriptor in flight is held by the kernel, so a side that dies leaks nothing. The
worker keeps its mappings of its last few batches, so that freeing their pages usually falls to
it rather than to the loop.

It uses the storage methods torch's own hand-off uses (``torch/multiprocessing/reductions.py``):
``UntypedStorage._new_using_fd_cpu``, ``_share_fd_cpu_`` and ``_new_shared_fd_cpu``, private but
there since torch 2.0 (checked on 2.13.0).
"""

from __future__ import annotations

import array
import collections
import itertools
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.defaults import LOADER_HANDOFF_TIMEOUT_S

#: The hand-offs of this process, by id: a :class:`SharedTensor` finds its own when the loop's
#: process (or its pin-memory thread) turns it back into a tensor.
_HANDOFFS: weakref.WeakValueDictionary[str, Handoff] = weakref.WeakValueDictionary()


def supported() -> bool:
    """Whether descriptors can be passed between processes here (Linux, macOS)."""
    return hasattr(socket, "AF_UNIX") and hasattr(socket.socket, "sendmsg") and hasattr(socket, "SCM_RIGHTS")


@dataclass(frozen=True)
class SharedTensor:
    """A tensor in shared memory on its way from a worker to the loop: its layout and the token
    of the descriptor the worker sent ahead of it."""

    handoff: str
    token: bytes
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int

    def tensor(self) -> torch.Tensor:
        """The tensor, mapped from its descriptor (in the loop's process)."""
        return _HANDOFFS[self.handoff].receive(self)

    def pin_memory(self, device: Any = None) -> torch.Tensor:
        """The tensor in pinned memory: the DataLoader's pin-memory thread calls this."""
        return self.tensor().pin_memory()


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def restore(obj: Any) -> Any:
    """``obj`` with each :class:`SharedTensor` in it (in tuples, lists, mappings) a tensor again."""
    return _map(obj, lambda leaf: leaf.tensor() if isinstance(leaf, SharedTensor) else leaf)


class Handoff:
    """Both ends of one loader's hand-off: called in a worker, it collates a batch and sends its
    tensors' descriptors; :meth:`receive` takes them in the loop's process.

    Args:
        collate: the loader's collate function (``default_collate`` or ``default_convert``).
        keep: batches a worker keeps mapped after sending them (its prefetch, plus one).
    """

    def __init__(self, collate: Callable[[Any], Any], keep: int) -> None:
        self.id = uuid.uuid4().hex
        self._collate = collate
        self._keep = keep
        # SEQPACKET: each descriptor's message arrives whole, whichever worker sent it.
        self._loop_end, self._worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._loop_end.settimeout(LOADER_HANDOFF_TIMEOUT_S)
        self._lock = threading.Lock()
        self._arrived: dict[bytes, int] = {}
        self._worker_state()
        _HANDOFFS[self.id] = self
        weakref.finalize(self, _close, self._loop_end, self._worker_end, self._arrived)

    def _worker_state(self) -> None:
        self._sequence: Any = None  # made in the worker, so that each worker counts its own
        self._kept: collections.deque[list[torch.UntypedStorage]] = collections.deque(maxlen=self._keep)

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker receives: the sending end only."""
        return {"id": self.id, "_collate": self._collate, "_keep": self._keep, "_worker_end": self._worker_end}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._worker_state()

    # -- in a worker ---------------------------------------------------------------------------

    def __call__(self, batch: Any) -> Any:
        storages: list[torch.UntypedStorage] = []
        out = _map(self._collate(batch), lambda leaf: self._send(leaf, storages))
        self._kept.append(storages)  # dropped once ``keep`` newer batches went out
        return out

    def _send(self, leaf: Any, storages: list[torch.UntypedStorage]) -> Any:
        if (not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu" or leaf.layout != torch.strided
                or leaf.untyped_storage().nbytes() == 0):  # torch pickles an empty one as such: no descriptor
            return leaf
        if self._sequence is None:
            self._sequence = itertools.count()
        tensor = leaf
        try:
            if not tensor.untyped_storage().is_shared():
                raise RuntimeError("not in shared memory yet")
            fd, nbytes = tensor.untyped_storage()._share_fd_cpu_()[:2]
        except RuntimeError:  # not shared, or shared by file name: a segment of our own
            storage = torch.UntypedStorage._new_using_fd_cpu(leaf.numel() * leaf.element_size())
            tensor = torch.empty(0, dtype=leaf.dtype).set_(storage, 0, leaf.shape, _contiguous(leaf.shape)).copy_(leaf)
            fd, nbytes = storage._share_fd_cpu_()[:2]
        token = f"{os.getpid()}.{next(self._sequence)}".encode()
        self._worker_end.sendmsg([token], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        storages.append(tensor.untyped_storage())
        return SharedTensor(self.id, token, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                            int(tensor.storage_offset()), nbytes)

    # -- in the loop's process -----------------------------------------------------------------

    def receive(self, shared: SharedTensor) -> torch.Tensor:
        """Map the tensor ``shared`` stands for.

        Raises:
            RuntimeError: its descriptor did not come (it is sent before the batch: a bug).
        """
        with self._lock:
            while shared.token not in self._arrived:
                token, fd = self._next_descriptor()
                self._arrived[token] = fd
            fd = self._arrived.pop(shared.token)
            self._drop_older(shared.token)
        try:
            # Private, as in torch/multiprocessing/reductions.py (absent from torch's stubs).
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, shared.nbytes)  # type: ignore[attr-defined]
        finally:
            os.close(fd)
        return torch.empty(0, dtype=shared.dtype).set_(storage, shared.offset, shared.size, shared.stride)

    def _next_descriptor(self) -> tuple[bytes, int]:
        fds = array.array("i")
        try:
            token, ancillary, _, _ = self._loop_end.recvmsg(64, socket.CMSG_SPACE(fds.itemsize))
        except TimeoutError:
            raise RuntimeError(f"a loader worker's batch came without its shared memory in "
                               f"{LOADER_HANDOFF_TIMEOUT_S:g} s") from None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        return token, fds[0]

    def _drop_older(self, token: bytes) -> None:
        """Close the descriptors a worker sent before ``token``: their batches were dropped (a
        loop that stopped early; persistent workers drain them at the next epoch)."""
        pid, _, number = token.partition(b".")
        stale = [t for t in self._arrived if t.partition(b".")[0] == pid and int(t.partition(b".")[2]) < int(number)]
        for old in stale:
            os.close(self._arrived.pop(old))


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with ``leaf`` applied to everything that is not a tuple, list or mapping."""
    if isinstance(obj, tuple):
        items = [_map(item, leaf) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map(item, leaf) for item in obj]
    if isinstance(obj, Mapping):
        return {key: _map(value, leaf) for key, value in obj.items()}
    return leaf(obj)


def _close(loop_end: socket.socket, worker_end: socket.socket, arrived: dict[bytes, int]) -> None:
    for fd in arrived.values():
        os.close(fd)
    arrived.clear()
    loop_end.close()
    worker_end.close()
