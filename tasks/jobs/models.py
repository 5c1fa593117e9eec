"""Models the built-in ``train`` and ``hogwild`` jobs can train (an MLP and a small CNN), and the
parameters both take: what to train, on what, for how long."""

from __future__ import annotations

import math
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ..core.errors import DatasetError


class ModelName(str, Enum):
    MLP = "mlp"
    CNN = "cnn"


class TrainingParams(BaseModel):
    """What ``train`` and ``hogwild`` share: the model, the dataset and its split, the training."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = ModelName.MLP
    #: ``digits`` (scikit-learn's, shipped with the package) or a path to an ``.npz`` file.
    dataset: str = Field(default="digits", min_length=1)
    epochs: int = Field(default=20, ge=1, le=100_000)
    batch_size: int = Field(default=64, ge=1, le=1_000_000)
    lr: float = Field(default=3e-3, gt=0, le=10)
    hidden: int = Field(default=128, ge=1, le=65_536)
    seed: int = 0
    test_fraction: float = Field(default=0.2, gt=0, lt=1)


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
