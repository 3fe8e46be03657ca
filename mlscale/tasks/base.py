"""The task interface: what the trainer needs to know about a model and its data.

A task bundles a model factory, train and eval tensors, a loss and eval metrics. The trainer never
looks inside; any user task is a function returning a ``Task``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


@dataclass
class TensorData:
    """An in-memory data set: row i of ``inputs`` goes with row i of ``targets``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.targets):
            raise ValueError(f"inputs ({len(self.inputs)}) and targets ({len(self.targets)}) differ in length")

    def __len__(self) -> int:
        return len(self.inputs)

    def to(self, dtype: torch.dtype) -> TensorData:
        """Cast floating-point tensors to ``dtype``; integer labels stay as they are."""
        cast = [t.to(dtype) if t.is_floating_point() else t for t in (self.inputs, self.targets)]
        return TensorData(*cast)


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    loss = nn.functional.cross_entropy(outputs, targets).item()
    accuracy = (outputs.argmax(dim=1) == targets).float().mean().item()
    return {"accuracy": accuracy, "loss": loss}


def regression_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"mse": nn.functional.mse_loss(outputs, targets).item()}


@dataclass
class Task:
    """A model and its data. ``build_model`` must create the same weights under the same torch seed."""

    name: str
    build_model: Callable[[], nn.Module]
    train: TensorData
    eval: TensorData
    loss_fn: LossFn = nn.functional.cross_entropy
    metrics_fn: MetricsFn = classification_metrics
    info: dict[str, object] = field(default_factory=dict)
    # A deterministic per-sample transform of the inputs, run by the input pipeline (in its worker
    # processes, cached with --data-cache); the trainer transforms the eval split the same way.
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
