"""Tasks declared for the tests: a small model that misbehaves on request, to test the server's handling
of slow and failing model calls on the torch runtime."""

from __future__ import annotations

import time

import torch
from torch import nn

from mlscale import Task, TensorData, declare_task

SLOW, FAIL = 1000.0, -1000.0  # the first input of a row asks the model to be slow, or to fail


class Misbehaving(nn.Module):
    """A linear layer that sleeps ``sleep_s`` on a row starting with SLOW and raises on one with FAIL."""

    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.linear, self.sleep_s = nn.Linear(4, 3), sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0] == FAIL).any():
            raise RuntimeError("secret internal detail: /srv/models/weights.bin is corrupt")
        if (x[:, 0] == SLOW).any():
            time.sleep(self.sleep_s)
        return self.linear(x)


@declare_task
def misbehaving(sleep_s: float = 3.0) -> Task:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(64, 4, generator=generator)
    y = torch.randint(0, 3, (64,), generator=generator)
    return Task(name="misbehaving", build_model=lambda: Misbehaving(sleep_s), train=TensorData(x[:48], y[:48]),
                eval=TensorData(x[48:], y[48:]))


def undeclared() -> Task:
    """The same factory without the declaration: mlscale must refuse to call it."""
    return misbehaving()
