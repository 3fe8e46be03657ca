"""The task interface: what the trainer needs to know about a model and its data.

A task bundles a model factory, train and eval tensors, a loss and eval metrics. The trainer never
looks inside; any user task is a function returning a ``Task``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlscale.data.tensors import TensorData

if TYPE_CHECKING:
    from mlscale.data.parquet import ParquetData

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    loss = nn.functional.cross_entropy(outputs, targets).item()
    accuracy = (outputs.argmax(dim=1) == targets).float().mean().item()
    return {"accuracy": accuracy, "loss": loss}


def regression_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"mse": nn.functional.mse_loss(outputs, targets).item()}


@dataclass
class Task:
    """A model and its data. ``build_model`` must create the same weights under the same torch seed.
    The training split is in memory, or Parquet files streamed by row group (``ParquetData``); the
    held-out split is in memory."""

    name: str
    build_model: Callable[[], nn.Module]
    train: TensorData | ParquetData
    eval: TensorData
    loss_fn: LossFn = nn.functional.cross_entropy
    metrics_fn: MetricsFn = classification_metrics
    info: dict[str, object] = field(default_factory=dict)
    # A deterministic per-sample transform of the inputs, run by the input pipeline (in its worker
    # processes, cached with --data-cache); the trainer transforms the eval split the same way.
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    # How --strategy tp (and fsdp --tp) splits the model: module-name patterns (``*``: any one name, such as
    # a block's index) -> "colwise" | "rowwise" | "colwise_gather_output" | "embedding_rowwise" (the words of
    # Hugging Face's ``_tp_plan``). Without one, the model's own declared plan is used, else tinylm's.
    tp_plan: dict[str, str] | None = None

    def example_inputs(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """``rows`` inputs as the model receives them (held-out samples, repeated if there are fewer,
        transformed like the training samples, floats in ``dtype``): what a strategy that traces the
        model (a pipeline) traces it on. Only the rows taken are transformed."""
        held_out = self.eval.inputs
        inputs = held_out[torch.arange(rows) % len(held_out)]
        inputs = inputs.to(dtype) if inputs.is_floating_point() else inputs  # as the trainer casts its data
        if self.transform is not None:
            inputs = torch.stack([self.transform(x) for x in inputs])
        return inputs
