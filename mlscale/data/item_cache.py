"""``--data-cache`` for a user's Dataset: each item, as ``__getitem__`` made it, kept by index.

Items of a user's Dataset may differ in shape (text of any length), so they are not rows of one tensor
(``pipeline.SampleCache``) but one safetensors file each (no pickle: tensors and a JSON description of
the item's structure), written under a temporary name and renamed, so a reader finds a whole item or
none. ``disk`` keeps them in the run directory, where a restarted run finds them; ``memory`` in shared
memory (``/dev/shm``), shared by the DataLoader's worker processes and the training process, removed
when the loader closes. A cache holds what ``__getitem__`` returned once: the task declares that its
items are deterministic by asking for one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save
from torch.utils import _pytree as pytree

from mlscale.errors import UsageError

SHARED_MEMORY = Path("/dev/shm")


class ItemCache:
    """Items by index in ``directory`` (one file each); ``owned`` directories are removed by ``close``."""

    def __init__(self, directory: Path, owned: bool) -> None:
        self.directory, self.owned = directory, owned
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, index: int) -> Path:
        return self.directory / f"{index}.safetensors"

    def get(self, index: int) -> Any:
        try:
            data = self._path(index).read_bytes()
        except FileNotFoundError:
            return None
        tensors = load(data)
        spec = pytree.treespec_loads(json.loads(tensors.pop("__spec__").numpy().tobytes().decode()))
        return pytree.tree_unflatten([tensors[str(i)] for i in range(len(tensors))], spec)

    def put(self, index: int, item: Any) -> Any:
        """Keep ``item``; returns it as ``get`` will (every leaf a tensor)."""
        flat, spec = pytree.tree_flatten(item)
        tensors: dict[str, torch.Tensor] = {}
        for position, leaf in enumerate(flat):
            try:
                tensors[str(position)] = torch.as_tensor(leaf).contiguous().clone()
            except (TypeError, ValueError, RuntimeError):
                raise UsageError(f"--data-cache keeps tensors; sample {index} holds a {type(leaf).__name__}") from None
        described = json.dumps(pytree.treespec_dumps(spec)).encode()
        tensors["__spec__"] = torch.frombuffer(bytearray(described), dtype=torch.uint8)
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".part")
        with os.fdopen(handle, "wb") as out:
            out.write(save(tensors))
        os.replace(temporary, self._path(index))
        return pytree.tree_unflatten([tensors[str(i)] for i in range(len(flat))], spec)

    @property
    def size_mb(self) -> float:
        return sum(path.stat().st_size for path in self.directory.glob("*.safetensors")) / 2**20

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.directory, ignore_errors=True)


def make_item_cache(kind: str, directory: Path | None, key: str) -> ItemCache | None:
    """``none``: no cache; ``disk``: in ``directory`` (a subfolder by ``key``, which names the task, its
    options and the dtype: another task's items are never read as these); ``memory``: in shared memory."""
    if kind == "none":
        return None
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    if kind == "disk":
        if directory is None:
            raise ValueError("a disk cache needs a directory")
        return ItemCache(directory / f"items-{digest}", owned=False)
    root = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return ItemCache(Path(tempfile.mkdtemp(prefix=f"mlscale-items-{digest}-", dir=root)), owned=True)


__all__ = ["ItemCache", "make_item_cache"]
