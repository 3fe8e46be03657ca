"""Resumable checkpoints: one file per checkpoint, written atomically, loaded without pickle code.

A checkpoint is ``checkpoints/step_XXXXXXXX.pt``, written to a temporary name and renamed, so a crash
mid-write leaves only a temporary file that ``latest()`` never picks. Files are read with
``torch.load(weights_only=True)``: tensors and plain containers only, no arbitrary code.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlscale.io import atomic_write

_NAME = re.compile(r"^step_(\d{8})\.pt$")


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        path = atomic_write(self.path_for(step), lambda tmp: torch.save(state, tmp))
        self._prune()
        return path

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def load(self, path: str | Path) -> dict[str, Any]:
        return torch.load(path, map_location="cpu", weights_only=True)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            self.path_for(step).unlink(missing_ok=True)


def capture_rng() -> dict[str, Any]:
    """Every random number generator a training step may draw from, as plain data."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
