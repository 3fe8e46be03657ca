"""Where a model came from: data set fingerprint and code version, recorded at training time."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import Dataset

from mlscale import __version__
from mlscale.data.parquet import ParquetData
from mlscale.data.tensors import TensorData


def data_fingerprint(*datasets: TensorData | ParquetData | Dataset[Any]) -> str:
    """SHA-256 over the exact bytes (and shapes and dtypes) of the data sets, in order; of Parquet data,
    over the bytes of its files and which of their row groups and columns it reads; of a user's Dataset,
    over its type, its size and the bytes of up to ``DATASET_PROBES`` items spread evenly over it (items
    are made by the user's code, maybe slowly: reading them all could take as long as an epoch)."""
    digest = hashlib.sha256()
    for data in datasets:
        if isinstance(data, ParquetData):
            data.fingerprint(digest)
            continue
        if not isinstance(data, TensorData):
            _dataset_fingerprint(data, digest)
            continue
        for tensor in (data.inputs, data.targets):
            digest.update(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor.contiguous().cpu().numpy().tobytes())
    return "sha256:" + digest.hexdigest()


DATASET_PROBES = 64


def _dataset_fingerprint(data: Dataset[Any], digest: Any) -> None:
    size = len(data)  # type: ignore[arg-type]
    digest.update(f"{type(data).__module__}.{type(data).__qualname__}:{size}".encode())
    for index in sorted({size * k // DATASET_PROBES for k in range(DATASET_PROBES)} if size else ()):
        try:
            item = data[index]
        except Exception as exc:  # a bad sample (skipped by --bad-samples skip) is part of what the data is
            digest.update(f"{index}:unreadable:{type(exc).__name__}".encode())
            continue
        for leaf in pytree.tree_leaves(item):
            tensor = torch.as_tensor(leaf)
            digest.update(f"{index}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(tensor.contiguous().cpu().numpy().tobytes())


def code_version(where: str | Path = ".") -> dict[str, str | bool | None]:
    """mlscale's version and, inside a git work tree, its commit and whether it had local changes."""
    version: dict[str, str | bool | None] = {"mlscale": __version__, "git_commit": None, "git_dirty": None}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            version["git_commit"] = commit.stdout.strip()
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                    capture_output=True, text=True, timeout=5)
            version["git_dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return version
