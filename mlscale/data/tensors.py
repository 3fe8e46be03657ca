"""In-memory data sets: the form of a task's data that the loaders index directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def batch(self, indices: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``indices`` of the inputs and of the targets (the same in every epoch)."""
        return self.inputs[indices], self.targets[indices]

    def to(self, dtype: torch.dtype) -> TensorData:
        """Cast floating-point tensors to ``dtype``; integer labels stay as they are."""
        cast = [t.to(dtype) if t.is_floating_point() else t for t in (self.inputs, self.targets)]
        return TensorData(*cast)
