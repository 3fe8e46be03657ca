"""Shared-memory batch buffers that a data worker reuses, instead of a fresh segment for every batch.

A DataLoader worker hands each batch to the training process in shared memory, and torch stacks each of a
batch's tensors into a new segment: created, mapped, faulted in page by page (zeroed by the kernel first),
then unmapped and freed when the training process drops the batch. For batches of 64 crops of 224 px that is
9.6 MB of fresh pages a batch, kernel time in the worker and in the trainer (the images suite's loader at
0.78x the ceiling of decoding alone). Here each worker keeps a ring of the segments it made and stacks a new
batch into one the training process has let go of; its pages are already there.

Who may write a segment is one byte in a small shared array that the loader makes before its workers start
(``BatchBuffers.in_use``: a run of ``slots`` bytes a worker). The worker sets its byte (0 -> 1) when it
stacks a tensor into that slot (``BufferedCollate``, around the loader's collate: the collate's stacking
asks ``shared_empty`` for its output), and says which slots the batch took. The training process clears
them when no tensor it holds views the batch's shared memory any more (``BatchBuffers.hold``:
``weakref.finalize`` on the storages of the batch it yielded), so a batch the user keeps, or a view of one,
keeps its slots: a slot is never rewritten while the trainer can still read it. With no slot free, the
worker makes a fresh segment, as torch does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from mlscale.data.batches import leaves

TENSORS_PER_BATCH = 4  # a batch's tensors that get a slot (a batch of images and labels needs 2)
SPARE = 2  # batches beyond the prefetched ones: the one the trainer holds, the one it just let go of


class _Ring:
    """A worker's slots: the segments it made, by slot, and its row of the shared ``in_use`` bytes."""

    def __init__(self, in_use: torch.Tensor, first: int, slots: int) -> None:
        self.flags = in_use[first:first + slots]  # a view: the training process sees the same bytes
        self.first = first
        self.storages: list[torch.UntypedStorage | None] = [None] * slots
        self.taken: list[int] = []  # the slots of the batch being collated, as indices of in_use

    def empty(self, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _nbytes(size, stride, dtype)
        slot = self._free(nbytes)
        if slot is None:  # every slot still read by the trainer: a fresh segment, as torch makes
            storage = torch.UntypedStorage._new_shared(nbytes)
        else:
            storage = self.storages[slot]
            if storage is None or storage.nbytes() != nbytes:  # another size: the slot gets a new segment
                storage = self.storages[slot] = torch.UntypedStorage._new_shared(nbytes)
            self.flags[slot] = 1
            self.taken.append(self.first + slot)
        return _tensor_on(storage, size, stride, dtype)

    def _free(self, nbytes: int) -> int | None:
        """A released slot: one of this size first (the same tensor of the next batch), else one never used,
        else any (its segment replaced)."""
        free = [slot for slot, flag in enumerate(self.flags.tolist()) if flag == 0]
        made = {slot: storage.nbytes() for slot, storage in enumerate(self.storages) if storage is not None}
        sized = [slot for slot in free if made.get(slot) == nbytes]
        unused = [slot for slot in free if slot not in made]
        return (sized or unused or free or [None])[0]

    def give_back(self) -> None:
        """The slots of a batch that failed to collate: nobody will read them."""
        self.flags[[slot - self.first for slot in self.taken]] = 0
        self.taken = []


def _nbytes(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    """The bytes of storage a tensor of ``size``, ``stride`` and ``dtype`` needs."""
    return _extent(size, stride) * torch.empty(0, dtype=dtype).element_size()


def _tensor_on(storage: torch.UntypedStorage, size: Sequence[int], stride: Sequence[int],
               dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(size), tuple(stride))


def _extent(size: Sequence[int], stride: Sequence[int]) -> int:
    """The elements a tensor of ``size`` and ``stride`` spans in its storage."""
    if any(extent == 0 for extent in size):
        return 0
    return 1 + sum((extent - 1) * step for extent, step in zip(size, stride, strict=True))


_ACTIVE: _Ring | None = None  # the ring of the batch this worker is collating (collation is one thread)


def shared_empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory, for a data worker's stacking: in a slot of the worker's
    ring while ``BufferedCollate`` collates, else in a fresh segment."""
    if _ACTIVE is not None:
        return _ACTIVE.empty(size, stride, dtype)
    return _tensor_on(torch.UntypedStorage._new_shared(_nbytes(size, stride, dtype)), size, stride, dtype)


def in_ring() -> bool:
    """Whether this process is collating into a ring now (a data worker under ``BufferedCollate``)."""
    return _ACTIVE is not None


def shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into a slot of the ring while one is collating (else itself: torch moves it into a
    fresh segment when it sends it)."""
    if _ACTIVE is None:
        return tensor
    out = _ACTIVE.empty(tensor.shape, tensor.stride(), tensor.dtype)
    return out.copy_(tensor)


class BatchBuffers:
    """The loader's side: the slots' ``in_use`` bytes, shared with the workers it is made before, and their
    release when the batches that took them are no longer read."""

    def __init__(self, workers: int, prefetch: int) -> None:
        self.slots = (prefetch + SPARE) * TENSORS_PER_BATCH
        self.in_use = torch.zeros(workers * self.slots, dtype=torch.uint8).share_memory_()

    def collate(self, collate: Callable[[Any], Any]) -> BufferedCollate:
        return BufferedCollate(collate, self.in_use, self.slots)

    def hold(self, batch: Any, slots: list[int]) -> None:
        """Keep ``slots`` taken until no tensor of ``batch`` in shared memory (nor a view of one) is alive.
        Tensors that are not shared (copied to pinned memory) view no slot."""
        if not slots:
            return
        storages = {id(s): s for s in (t.untyped_storage() for t in leaves(batch) if t.is_shared())}
        if not storages:
            self.in_use[slots] = 0
            return
        held = _Held(self.in_use, slots, len(storages))
        for storage in storages.values():
            weakref.finalize(storage, held.drop).atexit = False


class _Held:
    """A yielded batch's slots, released when the last of its shared storages is freed (in whichever thread
    drops it: the training loop's, or the pin-memory thread's)."""

    def __init__(self, in_use: torch.Tensor, slots: list[int], storages: int) -> None:
        self.in_use, self.slots, self.left = in_use, slots, storages
        self.lock = threading.Lock()

    def drop(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.in_use[self.slots] = 0


class BufferedCollate:
    """A loader's collate in its data workers, stacking into the worker's ring: returns ``(batch, slots)``,
    the slots the batch took, which the training process gives to ``BatchBuffers.hold``."""

    def __init__(self, collate: Callable[[Any], Any], in_use: torch.Tensor, slots: int) -> None:
        self.inner, self.in_use, self.slots = collate, in_use, slots
        self._ring: _Ring | None = None  # made in the worker, on its first batch

    def __call__(self, items: Any) -> tuple[Any, list[int]]:
        global _ACTIVE
        if self._ring is None:
            worker = get_worker_info()
            first = (worker.id if worker is not None else 0) * self.slots
            self._ring = _Ring(self.in_use, first, self.slots)
        self._ring.taken = []
        _ACTIVE = self._ring
        try:
            batch = self.inner(items)
        except BaseException:
            self._ring.give_back()
            raise
        finally:
            _ACTIVE = None
        return batch, self._ring.taken


__all__ = ["BatchBuffers", "BufferedCollate", "in_ring", "shared_copy", "shared_empty"]
