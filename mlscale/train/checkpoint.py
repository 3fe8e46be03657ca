"""Resumable checkpoints: one file per checkpoint, written atomically, loaded without pickle code.

A checkpoint is ``checkpoints/step_XXXXXXXX.pt``, written to a temporary name and renamed, so a crash
mid-write leaves only a temporary file that is never taken for a checkpoint. Resuming takes the newest
checkpoint that loads; a damaged one (truncated by a disk fault, say) is skipped with a warning.
Files are read with ``torch.load(weights_only=True)``: tensors and plain containers, no code.

Asynchronous saving (the default) copies the state to CPU memory on the training thread — the only
stall — and writes it on a background thread, as torch.distributed.checkpoint's ``async_save`` does.
At most one save is in flight; the next save, and the end of training, wait for it.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlscale.io import atomic_write

_NAME = re.compile(r"^step_(\d{8})\.pt$")
WriteHook = Callable[[int, Path], None]


def snapshot(state: Any) -> Any:
    """A deep copy whose tensors live in CPU memory and are not shared with the training state."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return state


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = False,
                 write_hook: WriteHook | None = None) -> None:
        self.directory = Path(directory)
        self.keep, self.async_save, self.write_hook = keep, async_save, write_hook
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.write_ms: list[float] = []  # how long each file took to write, wherever it was written

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as the checkpoint of ``step``; returns once training may go on."""
        self.wait()
        if not self.async_save:
            self._write(step, state)
            return
        copy = snapshot(state)
        self._thread = threading.Thread(target=self._write_in_background, args=(step, copy),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight is on disk; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write_in_background(self, step: int, state: dict[str, Any]) -> None:
        try:
            self._write(step, state)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

    def _write(self, step: int, state: dict[str, Any]) -> None:
        def write(tmp: Path) -> None:
            torch.save(state, tmp)
            if self.write_hook is not None:
                self.write_hook(step, tmp)

        start = time.perf_counter()
        atomic_write(self.path_for(step), write)
        self.write_ms.append((time.perf_counter() - start) * 1e3)
        self._prune()

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

    def load_latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads, newest first; ``None`` when there is none."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                return path, self.load(path)
            except Exception as exc:  # a damaged file: say so and fall back to the one before
                print(f"mlscale: skipping damaged checkpoint {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None

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
