"""Datasets the built-in ``train`` job reads: scikit-learn's digits, or an ``.npz`` file.

An ``.npz`` dataset holds ``x`` (samples x features, or samples x 1 x H x W) and ``y``
(integer class labels). Everything is loaded once into CPU tensors; the DataLoader's workers
share them with the training process instead of copying them.
"""

from __future__ import annotations

import functools
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.errors import DatasetError


@dataclass
class Split:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    name: str

    @property
    def features(self) -> int:
        return int(self.x_train[0].numel())


@functools.cache  # a pack loads it once per member too
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, read once per process: public, read-only data (the arrays are
    made read-only, and :func:`load` hands every job copies), where parsing its CSV again took
    a tenth of a small trial. A user's ``.npz`` is never kept between jobs."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    x.flags.writeable = y.flags.writeable = False
    return x, y


def _npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "x" not in data or "y" not in data:
                raise DatasetError(
                    f"dataset file {str(path)!r} lacks array 'x' or 'y' (has {sorted(data.files)})"
                )
            x, y = np.asarray(data["x"]), np.asarray(data["y"])
    except DatasetError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DatasetError(f"dataset file {str(path)!r} is not a readable .npz file: {exc}") from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) < 2:
        raise DatasetError(
            f"dataset file {str(path)!r}: expected x of shape (N, ...) and y of shape (N,), "
            f"got x{x.shape} and y{y.shape}"
        )
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise DatasetError(f"dataset file {str(path)!r}: y must hold class indices >= 0")
    if not np.isfinite(x).all():
        raise DatasetError(f"dataset file {str(path)!r}: x holds NaN or infinite values")
    return x.astype(np.float32), y.astype(np.int64)


def load(dataset: str, *, test_fraction: float, seed: int) -> Split:
    """Load ``dataset`` (a built-in name or an ``.npz`` path) and split it, reproducibly.

    Raises:
        DatasetError: the file is missing, unreadable or malformed.
    """
    x, y = _digits() if dataset == "digits" else _npz(Path(dataset).expanduser())
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=generator)
    n_test = max(1, int(round(len(y) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    # as_tensor shares the (possibly cached, read-only) arrays; the indexing below copies them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": never written here
        xs, ys = torch.as_tensor(x.reshape(len(x), -1)), torch.as_tensor(y)
    return Split(
        x_train=xs[train].contiguous(),
        y_train=ys[train].contiguous(),
        x_test=xs[test].contiguous(),
        y_test=ys[test].contiguous(),
        classes=int(y.max()) + 1,
        name=dataset,
    )
