"""A user's map-style ``torch.utils.data.Dataset`` as mlscale's loaders read it.

Any object with ``__len__`` and ``__getitem__`` whose item ``i`` is ``(inputs, target)``: ``inputs`` a
tensor, a tuple of tensors or a dict of tensors, ``target`` a tensor (or a number) or a dict of them.
``MapData`` reads items by data-set index and collates them into batches with the task's collate
(default: ``stack``); the loaders pick the indices (``sampler.shard_indices``), so the sharding contract
is the same as for in-memory tensors. A failure reading or collating names the sample index and the
user's exception in one line (``SampleError``), also from a DataLoader worker process.

A Dataset whose items depend on the epoch (random augmentation that must be the same after a resume, at
any world size or number of data workers) defines ``item_for_epoch(index, epoch)``: mlscale calls it with
the epoch of the batch instead of ``dataset[index]`` (``images.ImageFolder`` draws its crops so).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from mlscale.data.batches import Tree, cast_floats
from mlscale.data.collate import split_items, stack
from mlscale.errors import MlscaleError, UsageError, first_line

Collate = Callable[[list[Any]], tuple[Tree, Tree]]


class SampleError(MlscaleError):
    """Reading or collating samples of the user's Dataset failed; the message names the sample(s).

    Raised in a DataLoader worker it reaches the training process as ``SampleError`` again, its message
    wrapped in torch's worker traceback: ``message_of`` takes the line back out."""


_WRAPPED = re.compile(r"(?:^|\n)(?:[\w.]+\.)?SampleError: (.+?)\s*$")


def message_of(exc: BaseException) -> str:
    """The one line a ``SampleError`` was raised with, also when torch's DataLoader re-raised it from a
    worker (its text then holds the worker's whole traceback, ending in that line)."""
    text = str(exc)
    found = _WRAPPED.search(text)
    return found.group(1) if found else first_line(text)


def _mistake(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


class MapData:
    """Batches of a map-style Dataset: items by index, collated, floats cast to ``dtype``."""

    def __init__(self, dataset: Dataset[Any], collate: Collate | None = None, dtype: torch.dtype | None = None,
                 name: str = "the training Dataset", skip_bad: bool = False) -> None:
        """``skip_bad``: a sample that fails to read is left out of its batch and noted in ``bad`` (``--bad-samples
        skip``), instead of raising."""
        self.dataset, self.collate_fn, self.dtype, self.name = dataset, collate, dtype, name
        self.skip_bad = skip_bad
        self.bad: list[dict[str, Any]] = []  # {"index", "error"} of samples left out, in this process
        try:
            self.size = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise UsageError(f"{name} ({type(dataset).__name__}) has no __len__: mlscale shards a map-style "
                             "Dataset by index and needs its size") from None

    def __len__(self) -> int:
        return self.size

    def to(self, dtype: torch.dtype) -> MapData:
        return MapData(self.dataset, self.collate_fn, dtype, self.name, self.skip_bad)

    def skipping(self, skip: bool) -> MapData:
        return MapData(self.dataset, self.collate_fn, self.dtype, self.name, skip)

    @property
    def per_epoch(self) -> bool:
        """Whether items depend on the epoch (the Dataset defines ``item_for_epoch``)."""
        return callable(getattr(self.dataset, "item_for_epoch", None))

    def item(self, index: int, epoch: int = 0) -> Any:
        """Item ``index`` as ``__getitem__`` (or ``item_for_epoch``) gives it; any failure is a
        ``SampleError`` naming the index."""
        try:
            item = self.dataset.item_for_epoch(index, epoch) if self.per_epoch else self.dataset[index]
        except IndexError as exc:
            raise SampleError(f"sample {index} of {self.name}: __getitem__ raised IndexError ({first_line(exc)}) "
                              f"although __len__ says {self.size:,} samples") from None
        except Exception as exc:
            raise SampleError(f"sample {index} of {self.name}: {_mistake(exc)}") from None
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            kind = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
            raise SampleError(f"sample {index} of {self.name} is {kind}; an item must be an (inputs, target) pair: "
                              "inputs a tensor, a tuple or a dict of tensors, target a tensor or a dict of them")
        return item

    def collate(self, items: list[Any], indices: Sequence[int] = ()) -> tuple[Tree, Tree]:
        """``items`` as one batch ``(inputs, targets)``, with the task's collate (else stacked)."""
        try:
            inputs, targets = (self.collate_fn or stack)(items)
        except Exception as exc:
            where = f"samples {span(indices)} of {self.name}" if indices else f"a batch of {self.name}"
            if self.collate_fn is None and isinstance(exc, RuntimeError) and "equal size" in str(exc):
                raise SampleError(f"{where} cannot be stacked into one batch ({first_line(exc)}): samples of "
                                  "different lengths need a collate; give the task collate=mlscale.PadCollate(...)"
                                  ) from None
            raise SampleError(f"{where}: the collate failed: {_mistake(exc)}") from None
        return (cast_floats(inputs, self.dtype), cast_floats(targets, self.dtype)) if self.dtype else (inputs, targets)

    def batch(self, indices: torch.Tensor | Sequence[int], epoch: int = 0) -> tuple[Tree, Tree]:
        chosen = [int(i) for i in indices]
        read = [(i, self.read(i, epoch)) for i in chosen]
        kept = [(i, item) for i, item in read if not isinstance(item, Bad)]
        self.bad.extend(item.as_dict() for _, item in read if isinstance(item, Bad))
        return self.collate_kept(kept)

    def read(self, index: int, epoch: int = 0) -> Any:
        """``item``, or under ``skip_bad`` a ``Bad`` note in place of a sample that failed."""
        try:
            return self.item(index, epoch)
        except SampleError as exc:
            if not self.skip_bad:
                raise
            return Bad(index, epoch, str(exc))

    def collate_kept(self, kept: list[tuple[int, Any]]) -> tuple[Tree, Tree]:
        """The items left of a batch, collated; a batch of which none is left is an error even when skipping."""
        if not kept:
            raise SampleError(f"every sample of a batch of {self.name} failed to read (--bad-samples skip leaves "
                              "a batch none): the data set is broken, not a sample of it")
        return self.collate([item for _, item in kept], [i for i, _ in kept])

    def check(self) -> None:
        """What can be seen before training: a size, a first and a last item that are ``(inputs, target)``
        pairs, and a collate that takes them. Raises ``UsageError`` (exit 2)."""
        if self.size == 0:
            raise UsageError(f"{self.name} is empty (__len__ is 0)")
        try:
            ends = sorted({0, self.size - 1})
            self.batch(ends)
            split_items([self.item(i) for i in ends])
        except SampleError as exc:
            raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class Bad:
    """A sample left out under ``--bad-samples skip``: which, in which epoch, and why."""

    index: int
    epoch: int
    error: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "epoch": self.epoch, "error": self.error}


def span(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in list(indices)[:8])
    return f"[{shown}{', ...' if len(indices) > 8 else ''}]"


MAX_WORKERS = 256


class Items(Dataset[Any]):
    """``MapData``'s items by index, for a torch ``DataLoader`` (in its worker processes): read through
    ``cache`` when there is one (``item_cache.ItemCache``). Each worker notes in shared memory the index it
    is reading (``reading``), so that a worker process that dies in the user's code (a decoder's
    segfault) is reported with the sample it died on."""

    def __init__(self, data: MapData, cache: Any = None) -> None:
        self.data, self.cache = data, cache  # (data.skip_bad: a failed read gives a Bad note, collated apart)
        self.reading = torch.full((MAX_WORKERS,), -1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[int, Any]:
        index, epoch = key if isinstance(key, tuple) else (key, 0)  # (index, epoch) from an epoch-aware plan
        worker = get_worker_info()
        slot = worker.id % MAX_WORKERS if worker is not None else None
        if slot is not None:
            self.reading[slot] = index
        try:
            return index, self._read(index, epoch)
        finally:  # a Python exception is reported as itself; only a process that died leaves its index
            if slot is not None:
                self.reading[slot] = -1

    def _read(self, index: int, epoch: int) -> Any:
        if self.cache is not None:
            found = self.cache.get(index)
            if found is not None:
                return found
        item = self.data.read(index, epoch)
        if isinstance(item, Bad):
            return item
        # As the cache will give it back (numbers as tensors), so that a batch of fresh and cached items collates
        return self.cache.put(index, item) if self.cache is not None else item

    def in_flight(self) -> list[int]:
        """The indices worker processes were reading and have not finished (one, for a worker that died)."""
        return [int(i) for i in self.reading.tolist() if i >= 0]


class CollateIndexed:
    """The DataLoader's collate for ``Items``: the batch's ``(index, item)`` pairs through
    ``MapData.collate``, which names the samples when it fails."""

    def __init__(self, data: MapData) -> None:
        self.data = data

    def __call__(self, indexed: list[tuple[int, Any]]) -> tuple[Tree, Tree] | tuple[Tree, Tree, list[dict[str, Any]]]:
        """The batch; under ``--bad-samples skip`` also the notes of the samples left out (a third element)."""
        bad = [item.as_dict() for _, item in indexed if isinstance(item, Bad)]
        batch = self.data.collate_kept([(i, item) for i, item in indexed if not isinstance(item, Bad)])
        return (*batch, bad) if self.data.skip_bad else batch


def is_map_dataset(source: Any) -> bool:
    """A user's Dataset (anything indexable with a size that is not one of mlscale's own data forms)."""
    return hasattr(source, "__getitem__") and hasattr(source, "__len__") and not isinstance(source, torch.Tensor)


__all__ = ["Collate", "CollateIndexed", "Items", "MapData", "SampleError", "is_map_dataset", "message_of", "span"]
