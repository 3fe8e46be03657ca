"""A Hugging Face ``datasets.Dataset`` (Arrow, in memory or memory-mapped) as a map-style Dataset.

``HFDataset(data, inputs=["input_ids", "attention_mask"], target="label")`` makes item ``i`` the pair
``({"input_ids": ..., "attention_mask": ...}, label)`` as tensors (the data set's torch format: Arrow
columns read row by row, no copy of the table), so a model is called ``model(**inputs)``;
``inputs="pixel_values"`` (one name) makes the input a tensor, ``model(inputs)``. Rows of different
lengths are padded by the task's collate (``mlscale.PadCollate``). Installed with ``mlscale[datasets]``;
this module imports nothing of ``datasets`` itself: it reads the object it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from mlscale.errors import UsageError


class HFDataset(Dataset[Any]):
    """Item ``i`` of a ``datasets.Dataset``: its ``inputs`` columns (a dict, or one tensor when ``inputs``
    is one name) and its ``target`` column (or a dict of several), as tensors."""

    def __init__(self, data: Any, inputs: str | Sequence[str], target: str | Sequence[str]) -> None:
        columns = getattr(data, "column_names", None)
        if columns is None or not hasattr(data, "with_format"):
            raise UsageError(f"HFDataset takes a datasets.Dataset, not a {type(data).__name__}")
        wanted = [inputs] if isinstance(inputs, str) else list(inputs)
        targets = [target] if isinstance(target, str) else list(target)
        if not wanted:
            raise UsageError("HFDataset needs at least one input column")
        missing = [name for name in [*wanted, *targets] if name not in columns]
        if missing:
            raise UsageError(f"HFDataset: the data set has no column {', '.join(map(repr, missing))} "
                             f"(its columns: {', '.join(columns)})")
        self.inputs, self.target = inputs, target
        self.data = data.with_format("torch", columns=[*wanted, *[t for t in targets if t not in wanted]])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.data[int(index)]
        inputs = row[self.inputs] if isinstance(self.inputs, str) else {name: row[name] for name in self.inputs}
        target = row[self.target] if isinstance(self.target, str) else {name: row[name] for name in self.target}
        return inputs, _tensor(target)


def _tensor(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _tensor(item) for key, item in value.items()}
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


__all__ = ["HFDataset"]
