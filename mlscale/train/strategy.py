"""The strategy interface: how a model is spread over workers and how workers talk.

The trainer calls only these methods and never asks which strategy it runs. A strategy wraps the plain
model for training, gives the plain model back for saving, and reports its communication time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import nn

from mlscale.train.dist import DistEnv
from mlscale.train.timing import CommTimer


class Strategy(ABC):
    name: ClassVar[str]

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.comm = CommTimer()

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the trainer runs forward and backward through."""

    @abstractmethod
    def unwrap(self, module: nn.Module) -> nn.Module:
        """The plain model inside ``module`` (no wrapper prefixes in its state dict)."""

    def comm_times(self, backward_end: float) -> tuple[float, float]:
        """(busy_ms, exposed_ms) of this step's communication; see ``CommTimer``."""
        return self.comm.take(backward_end)
