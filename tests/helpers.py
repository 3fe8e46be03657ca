"""Shared test helpers: run the real CLI in a subprocess, read a run's weights, tasks that fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from mlscale.tasks import Task, declare_task, make_task

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m mlscale ARGS`` as a user runs it; a hang fails the test after ``timeout``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mlscale", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class _Exploding(nn.Module):
    """Wraps a model and raises on one rank at one step, as a user's bug would."""

    def __init__(self, inner: nn.Module, rank: int, step: int) -> None:
        super().__init__()
        self.inner, self.rank, self.step, self.calls = inner, rank, step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ.get("RANK", 0)) == self.rank and self.calls == self.step:
            raise RuntimeError(f"boom on rank {self.rank} at step {self.step}")
        return self.inner(x)


@declare_task
def exploding_task(rank: int = 1, step: int = 3) -> Task:
    task = make_task("digits")
    inner = task.build_model
    task.build_model = lambda: _Exploding(inner(), rank, step)
    return task
