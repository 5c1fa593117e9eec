"""Models the built-in ``train`` job can train: an MLP and a small CNN."""

from __future__ import annotations

import math
from enum import Enum

from torch import nn

from ..core.errors import DatasetError


class ModelName(str, Enum):
    MLP = "mlp"
    CNN = "cnn"


def build(name: ModelName, features: int, classes: int, hidden: int) -> nn.Module:
    """A fresh model for inputs of ``features`` values and ``classes`` outputs."""
    if name is ModelName.MLP:
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )
    side = math.isqrt(features)
    if side * side != features or side < 4:
        raise DatasetError(
            f"model 'cnn' needs square single-channel images; {features} features are not "
            "a square of side >= 4 (use model 'mlp')"
        )
    pooled = side // 2
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * pooled * pooled, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )
