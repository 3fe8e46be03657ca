"""The task interface: what the trainer needs to know about a model and its data.

A task bundles a model factory, train and eval data, a loss and eval metrics. The data is in-memory
tensors (``TensorData``), Parquet files (``ParquetData``, training only) or any map-style
``torch.utils.data.Dataset`` whose items are ``(inputs, target)``, batched by the task's ``collate``.
The trainer never looks inside; any user task is a function returning a ``Task``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from mlscale.data.batches import Tree
from mlscale.data.dataset import Collate, MapData, is_map_dataset
from mlscale.data.parquet import ParquetData
from mlscale.data.tensors import TensorData
from mlscale.errors import UsageError

if TYPE_CHECKING:
    from mlscale.data.parquet import ParquetData

LossFn = Callable[[Any, Any], torch.Tensor]  # (the model's output, the batch's targets) -> the loss
MetricsFn = Callable[[Any, Any], dict[str, float]]


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    loss = nn.functional.cross_entropy(outputs, targets).item()
    accuracy = (outputs.argmax(dim=1) == targets).float().mean().item()
    return {"accuracy": accuracy, "loss": loss}


def regression_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"mse": nn.functional.mse_loss(outputs, targets).item()}


@dataclass
class Task:
    """A model and its data. ``build_model`` must create the same weights under the same torch seed.
    The training split is in memory, Parquet files streamed by row group (``ParquetData``) or a map-style
    ``Dataset``; the held-out split is in memory or a ``Dataset``. A Dataset's item is ``(inputs, target)``;
    the model is called ``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, ``model(inputs)``
    for a tensor, and the loss and metrics get its output and the batch's targets."""

    name: str
    build_model: Callable[[], nn.Module]
    train: TensorData | ParquetData | Dataset[Any]
    eval: TensorData | Dataset[Any]
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
    # A Dataset's items into one batch: a function from a list of ``(inputs, target)`` items to
    # ``(inputs, targets)``. Default: stacked (``mlscale.data.collate.stack``); ``mlscale.PadCollate`` pads
    # samples of different lengths.
    collate: Collate | None = None

    def train_data(self) -> TensorData | ParquetData | MapData:
        """The training split in the form the loaders read (a Dataset wrapped with the task's collate)."""
        return self._data(self.train, "the training Dataset")

    def eval_data(self) -> TensorData | MapData:
        data = self._data(self.eval, "the held-out Dataset")
        if not isinstance(data, (TensorData, MapData)):
            raise UsageError(f"task {self.name!r}: the held-out split must be in memory or a Dataset")
        return data

    def _data(self, source: Any, name: str) -> Any:
        if isinstance(source, (TensorData, ParquetData)):
            return source
        if not is_map_dataset(source):
            raise UsageError(f"task {self.name!r}: {name.removeprefix('the ')} is a {type(source).__name__}; give "
                             "TensorData, ParquetData or a map-style torch Dataset (__len__ and __getitem__)")
        if self.transform is not None:
            raise UsageError(f"task {self.name!r}: Task.transform applies to TensorData; a Dataset transforms its "
                             "items in its own __getitem__")
        return MapData(source, self.collate, name=name)

    def example_batch(self, rows: int, dtype: torch.dtype) -> tuple[Tree, Tree]:
        """``rows`` held-out samples (repeated if there are fewer) as the model receives them: transformed
        like the training samples, collated, floats in ``dtype``. Only the rows taken are transformed."""
        held_out = self.eval_data().to(dtype)
        indices = torch.arange(rows) % len(held_out)
        inputs, targets = held_out.batch(indices)
        if self.transform is not None:
            inputs = torch.stack([self.transform(x) for x in inputs])
        return inputs, targets

    def example_inputs(self, rows: int, dtype: torch.dtype) -> Tree:
        """``rows`` inputs as the model receives them (``example_batch``): what a strategy that traces
        the model (a pipeline) traces it on, and what an export is checked on."""
        return self.example_batch(rows, dtype)[0]
