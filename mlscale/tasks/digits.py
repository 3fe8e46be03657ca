"""The ``digits`` task: 1,797 real 8x8 handwritten digits (UCI, shipped in the package).

Split 80/20 into train/eval by a fixed permutation, so every run sees the same split.
"""

from __future__ import annotations

import gzip
from importlib import resources

import numpy as np
import torch
from torch import nn

from mlscale.tasks.base import Task, TensorData

N_PIXELS = 64
N_CLASSES = 10


def load_digits() -> TensorData:
    """All 1,797 images as float32 in [0, 1] (shape N x 64) with int64 labels."""
    with resources.files("mlscale.tasks").joinpath("data/digits.csv.gz").open("rb") as raw, \
            gzip.open(raw) as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float32)
    inputs = torch.from_numpy(table[:, :N_PIXELS] / 16.0)
    targets = torch.from_numpy(table[:, N_PIXELS].astype(np.int64))
    return TensorData(inputs, targets)


def split(data: TensorData, eval_fraction: float = 0.2, seed: int = 0) -> tuple[TensorData, TensorData]:
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    n_eval = int(len(data) * eval_fraction)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return (
        TensorData(data.inputs[train_idx], data.targets[train_idx]),
        TensorData(data.inputs[eval_idx], data.targets[eval_idx]),
    )


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_PIXELS, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions over the 8x8 image, then a linear classifier."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels * 16, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = x.reshape(-1, 1, 8, 8)
        return self.head(self.features(image).flatten(1))


def make_digits(model: str = "mlp", hidden: int = 128, channels: int = 16) -> Task:
    train, held_out = split(load_digits())
    if model == "mlp":
        factory = lambda: DigitsMLP(hidden)
    elif model == "cnn":
        factory = lambda: DigitsCNN(channels)
    else:
        raise ValueError(f"model must be 'mlp' or 'cnn', not {model!r}")
    return Task(name=f"digits-{model}", build_model=factory, train=train, eval=held_out,
                info={"inputs": N_PIXELS, "classes": N_CLASSES, "source": "UCI optical digits (test set)"})


def make_digits_cnn(channels: int = 16) -> Task:
    return make_digits(model="cnn", channels=channels)
