"""The ``synthetic`` task: generated data of any size and an MLP of any width, for benchmarks.

Targets come from a fixed random "teacher" network, so the task is learnable and the same for a seed.
"""

from __future__ import annotations

import torch
from torch import nn

from mlscale.tasks.base import Task, TensorData, regression_metrics


def mlp(inputs: int, width: int, depth: int, outputs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, outputs))
    return nn.Sequential(*layers)


def make_synthetic(
    kind: str = "classification",
    samples: int = 4096,
    features: int = 64,
    classes: int = 10,
    width: int = 256,
    depth: int = 2,
    data_seed: int = 1234,
    transform_rounds: int = 0,
) -> Task:
    if kind not in ("classification", "regression"):
        raise ValueError(f"kind must be 'classification' or 'regression', not {kind!r}")
    if min(samples, features, classes, width) < 1 or depth < 0:
        raise ValueError("samples, features, classes and width must be >= 1 and depth >= 0")
    generator = torch.Generator().manual_seed(data_seed)
    n_eval = max(1, samples // 5)
    inputs = torch.randn(samples + n_eval, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator) / features**0.5
    scores = inputs @ teacher
    if kind == "classification":
        targets = scores.argmax(dim=1)
        loss_fn, metrics_fn = nn.functional.cross_entropy, None
    else:
        targets = scores + 0.1 * torch.randn(scores.shape, generator=generator)
        loss_fn, metrics_fn = nn.functional.mse_loss, regression_metrics
    task = Task(
        name=f"synthetic-{kind}",
        build_model=lambda: mlp(features, width, depth, classes),
        train=TensorData(inputs[:samples], targets[:samples]),
        eval=TensorData(inputs[samples:], targets[samples:]),
        loss_fn=loss_fn,
        info={"inputs": features, "classes": classes, "width": width, "depth": depth},
    )
    if metrics_fn is not None:
        task.metrics_fn = metrics_fn
    if transform_rounds:
        task.transform = ExpensiveTransform(features, transform_rounds, data_seed)
    return task


class ExpensiveTransform:
    """Benchmarks of the input pipeline: a deterministic, CPU-bound per-sample transform (``rounds``
    rotations of the sample by a fixed orthogonal matrix, which keep it learnable)."""

    def __init__(self, features: int, rounds: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed + 1)
        self.rotation, _ = torch.linalg.qr(torch.randn(features, features, generator=generator))
        self.rounds = rounds

    def __call__(self, sample: torch.Tensor) -> torch.Tensor:
        rotation = self.rotation.to(sample.dtype)
        for _ in range(self.rounds):
            sample = rotation @ sample
        return sample
