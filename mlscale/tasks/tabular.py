"""The ``parquet`` task: an MLP over the numeric columns of a Parquet data set, streamed from disk.

Integer targets make it a classifier (classes: the largest label + 1, from the files' column
statistics), floating ones a regression. The held-out split is ``eval_path`` when given, else the
last row group of the data set (left out of training); it is read into memory (at most ``eval_rows``).
"""

from __future__ import annotations

import torch
from torch import nn

from mlscale.data.parquet import ParquetData
from mlscale.errors import UsageError
from mlscale.tasks.base import Task, TensorData, regression_metrics


class TabularMLP(nn.Module):
    """Two hidden layers; ``scalar`` drops the last dimension, for a regression on one target column."""

    def __init__(self, inputs: int, outputs: int, hidden: int, scalar: bool = False) -> None:
        super().__init__()
        self.scalar = scalar
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out.squeeze(-1) if self.scalar else out


def _held_out(data: ParquetData, eval_path: str, eval_rows: int) -> tuple[ParquetData, TensorData]:
    if eval_path:
        return data, ParquetData(eval_path, target=data.target, features=data.features).head(eval_rows)
    if len(data.groups) < 2:
        raise UsageError("bad value task-opt path: the Parquet data has one row group; the held-out split is the "
                         "last row group, so give it more (or --task-opt eval_path=...)")
    last = data.groups[-1]
    inputs, targets = data.read(last)
    return data.subset(data.groups[:-1]), TensorData(inputs[:eval_rows], targets[:eval_rows])


def make_parquet(path: str = "", target: str = "label", features: str = "", eval_path: str = "",
                 eval_rows: int = 2048, hidden: int = 64, classes: int = 0) -> Task:
    if not path:
        raise UsageError("task parquet needs --task-opt path=DIR (a directory, glob or file of Parquet data)")
    data = ParquetData(path, target=target, features=[f for f in features.split(",") if f] or None)
    train, held_out = _held_out(data, eval_path, eval_rows)
    inputs = held_out.inputs.shape[1]
    if held_out.targets.is_floating_point():
        outputs = 1 if held_out.targets.dim() == 1 else held_out.targets.shape[1]
        scalar = held_out.targets.dim() == 1
        factory = lambda: TabularMLP(inputs, outputs, hidden, scalar=scalar)
        return Task(name="parquet", build_model=factory, train=train, eval=held_out,
                    loss_fn=nn.functional.mse_loss, metrics_fn=regression_metrics,
                    info={"inputs": inputs, "outputs": outputs, "source": data.describe()})
    classes = classes or data.column_max(target) + 1
    return Task(name="parquet", build_model=lambda: TabularMLP(inputs, classes, hidden), train=train, eval=held_out,
                info={"inputs": inputs, "classes": classes, "source": data.describe()})
