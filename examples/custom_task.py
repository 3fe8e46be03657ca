"""A user's own task, declared with ``@declare_task`` and plugged in by import path:

    PYTHONPATH=. mlscale train --task examples.custom_task:make_task --task-opt hidden=32 --workers 2

mlscale only calls factories that were declared as tasks (a config file or a registry row naming any
other function is refused), and it imports them from the Python path as it is: ``PYTHONPATH=.`` makes
this folder's ``examples`` package importable.

A task is a model factory, train/eval tensors, a loss and metrics. Everything else (sharding,
data parallelism, checkpoints, reports) comes from mlscale.
"""

import torch
from torch import nn

from mlscale import Task, TensorData, declare_task


@declare_task
def make_task(hidden: int = 64, samples: int = 2048) -> Task:
    """Learn y = sin(3x) on [-1, 1]: a regression on 1-D inputs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(samples, 1, generator=generator) * 2 - 1
    y = torch.sin(3 * x)
    split = samples * 4 // 5

    def mse_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"mse": nn.functional.mse_loss(outputs, targets).item()}

    return Task(
        name="sine",
        build_model=lambda: nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)),
        train=TensorData(x[:split], y[:split]),
        eval=TensorData(x[split:], y[split:]),
        loss_fn=nn.functional.mse_loss,
        metrics_fn=mse_metrics,
    )
