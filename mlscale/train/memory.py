"""What a rank's training state occupies, measured on the tensors it really holds.

The bytes of the distinct storages behind this rank's parameters, gradients and optimizer state (a
sharded tensor counts its local shard only; views of one storage count once), and the process's peak:
the CUDA caching allocator's peak on a GPU, the peak resident set size on a CPU (which also holds the
Python interpreter, torch and the data, so it only ever adds to the state).
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

MB = 2**20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _holders(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose storages hold ``tensor``'s bytes on this rank: a DTensor's local shard, a
    wrapper subclass's inner tensors (a functional collective's ``AsyncCollectiveTensor``, which tp's
    layers return and activation checkpointing saves, has no storage of its own)."""
    tensor = _local(tensor)
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _holders(getattr(tensor, name))]


def storage_key(storage: torch.UntypedStorage) -> int:
    """What tells one storage from another: its address, or for a storage without one (the fake and meta
    tensors ``mlscale plan`` runs the step on, all at address 0) the storage object itself, which every
    view of it shares. The memory planner counts with these functions, so prediction and measurement
    count the same things."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` not in ``seen`` (which it extends)."""
    total = 0
    for holder in (plain for tensor in tensors for plain in _holders(tensor)):
        storage = holder.untyped_storage()
        if storage.nbytes() == 0 or storage_key(storage) in seen:
            continue
        seen.add(storage_key(storage))
        total += storage.nbytes()
    return total


def state_memory(params: Iterable[torch.nn.Parameter], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float]:
    """MB of this rank's parameters, gradients and optimizer state (taken after a step, when all exist)."""
    params = list(params)
    seen: set[int] = set()
    sizes = {
        "params_mb": storage_bytes(params, seen),
        "grads_mb": storage_bytes((p.grad for p in params if p.grad is not None), seen),
        "optimizer_mb": storage_bytes((value for optimizer in optimizers for state in optimizer.state.values()
                                        for value in state.values() if isinstance(value, torch.Tensor)), seen),
    }
    result = {key: value / MB for key, value in sizes.items()}
    result["state_mb"] = sum(result.values())
    return result


class SavedActivations:
    """Counts the bytes autograd keeps for the backward pass while active (the activations; under
    autocast also the low-precision copies of the weights), distinct storages once, parameters not."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.bytes = 0
        self._seen = {storage_key(holder.untyped_storage()) for p in params for holder in _holders(p)}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.nn.Parameter):  # a weight (FSDP's gathered ones too), not an activation
            return tensor
        self.bytes += storage_bytes([tensor], self._seen)
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def mb(self) -> float:
        return self.bytes / MB


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


MEMORY_KEYS = ("params_mb", "grads_mb", "optimizer_mb", "state_mb", "activations_mb")


# -- a memory cap per process (--memory-limit-mb) ---------------------------------------------------
def _data_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


class MemoryCap:
    """``--memory-limit-mb``: from ``arm()`` on, what this process may allocate is capped at ``limit_mb``
    MB above what it holds then, as a device of that size would be. The trainer arms it just before it
    builds the model, so the cap holds the training state (model, gradients, optimizer state,
    activations) and not the libraries and data loaded before, as a GPU's memory would.

    On a GPU: the CUDA caching allocator's per-process fraction. On a CPU: the kernel's data-segment limit
    (``RLIMIT_DATA``: heap and private writable mappings, where torch's tensors live), so an allocation
    past it fails in torch's allocator as it would on a full device. Lifted again by ``lift()``.
    """

    def __init__(self, limit_mb: float | None, device: torch.device) -> None:
        self.limit_mb, self.device = limit_mb, device
        self._lift: list[Callable[[], None]] = []

    def arm(self) -> None:
        if self.limit_mb is None or self._lift:
            return
        extra = int(self.limit_mb * MB)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = min(1.0, (torch.cuda.memory_allocated(self.device) + extra) / total)
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)
            self._lift.append(lambda: torch.cuda.set_per_process_memory_fraction(1.0, self.device))
            return
        _return_freed_memory()
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        cap = _data_bytes() + extra
        cap = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
        _CPU_CAPS.append((soft, hard, cap))

        def lift() -> None:
            _CPU_CAPS.remove((soft, hard, cap))
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

        self._lift.append(lift)

    def lift(self) -> None:
        while self._lift:
            self._lift.pop()()


@contextlib.contextmanager
def memory_limit(limit_mb: float | None, device: torch.device) -> Iterator[MemoryCap]:
    """A ``MemoryCap`` for the block, lifted on leaving it (an in-process run goes on uncapped)."""
    cap = MemoryCap(limit_mb, device)
    try:
        yield cap
    finally:
        cap.lift()


_CPU_CAPS: list[tuple[int, int, int]] = []  # (limit before, hard limit, cap) of the CPU caps in force


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Around work a GPU job does in host memory, not on the device: building the whole model on rank 0 to
    stream it out, gathering the trained model onto rank 0's CPU to write it. Where a CPU stands in for a
    device of ``--memory-limit-mb``, that work is not counted against the cap (a GPU's cap never sees it)."""
    if not _CPU_CAPS:
        yield
        return
    soft, hard, cap = _CPU_CAPS[-1]
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def _return_freed_memory() -> None:
    """Have glibc serve every allocation of 128 KiB or more from its own mapping, unmapped when freed.
    By default the threshold grows as large blocks are freed, and later tensors come from a heap that
    is rarely given back: memory freed by sharding would still count against the limit."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):  # not glibc: the limit still holds, only more conservatively
        pass


_M_MMAP_THRESHOLD = -3


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)
