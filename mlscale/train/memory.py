"""What a rank's training state occupies, measured on the tensors it really holds.

The bytes of the distinct storages behind this rank's parameters, gradients and optimizer state (a
sharded tensor counts its local shard only; views of one storage count once), and the process's peak:
the CUDA caching allocator's peak on a GPU, the peak resident set size on a CPU (which also holds the
Python interpreter, torch and the data, so it only ever adds to the state).
"""

from __future__ import annotations

import resource
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

MB = 2**20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def state_memory(params: Iterable[torch.nn.Parameter], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float]:
    """MB of this rank's parameters, gradients and optimizer state (taken after a step, when all exist)."""
    params = list(params)
    seen: set[int] = set()
    sizes = {
        "params_mb": _storage_bytes(params, seen),
        "grads_mb": _storage_bytes((p.grad for p in params if p.grad is not None), seen),
        "optimizer_mb": _storage_bytes((value for optimizer in optimizers for state in optimizer.state.values()
                                        for value in state.values() if isinstance(value, torch.Tensor)), seen),
    }
    result = {key: value / MB for key, value in sizes.items()}
    result["state_mb"] = sum(result.values())
    return result


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


MEMORY_KEYS = ("params_mb", "grads_mb", "optimizer_mb", "state_mb")
