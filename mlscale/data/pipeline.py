"""The input pipeline: torch's DataLoader (worker processes, prefetch, pinned memory) over the same
batches as ``ShardLoader``, with a per-sample transform and a cache, at the same exact position.

The batches are the ``ShardLoader``'s: this rank's shard of the epoch order, from a position on. The
DataLoader's batch sampler runs in this process and hands each batch's indices to the workers in
order; it records the position after each batch as it goes, and the batches come back in that order,
so the position of the batch just returned is always known: a resume mid-epoch reads exactly the
rest of the epoch, with or without workers (for in-memory data also at another world size; Parquet
data, ``parquet.py``, plans its own batches on ``StreamLoader``).

The transform (``Task.transform``) runs per sample in the workers: the parallel map. The cache holds
transformed samples by data-set row, filled as the epochs read them, so a sample is transformed once
(for deterministic transforms only: the task says so by declaring one): in shared memory, or in files
on disk that outlive the process, so that a restarted run finds the samples it had made.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from mlscale.common.io import atomic_write_json
from mlscale.data.batch_buffers import BatchBuffers
from mlscale.data.dataset import CollateIndexed, Items, MapData, SampleError, message_of, span
from mlscale.data.item_cache import make_item_cache
from mlscale.data.loader import Position, check_a_batch_fits, drop_bad
from mlscale.data.sampler import sample_shards, shard_indices
from mlscale.data.tensors import TensorData
from mlscale.errors import UsageError, first_line

Transform = Callable[[torch.Tensor], torch.Tensor]
CacheKind = Literal["none", "memory", "disk"]


class SampleCache:
    """Samples by data-set row, with a flag per row set after its data is written, so that a reader
    never takes half a sample. ``directory`` None: shared memory (the DataLoader workers write, the
    training process reads); else memory-mapped files there, which a restarted run opens again (the
    same run directory holds the same task and transform; a different shape, or ``source``, which
    names the files read, starts the cache over)."""

    def __init__(self, rows: int, sample: tuple[torch.Tensor, torch.Tensor], directory: Path | None = None,
                 source: str = "") -> None:
        inputs, target = sample
        self.directory = directory
        layout = {"rows": rows, "inputs": [list(inputs.shape), str(inputs.dtype)],
                  "targets": [list(target.shape), str(target.dtype)], "source": source}
        if directory is not None:
            if directory.exists() and _read_layout(directory) != layout:
                shutil.rmtree(directory)  # another layout: what is there cannot be read as these samples
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_json(directory / "layout.json", layout)
        self.inputs = self._tensor("inputs", (rows, *inputs.shape), inputs.dtype)
        self.targets = self._tensor("targets", (rows, *target.shape), target.dtype)
        self.filled = self._tensor("filled", (rows,), torch.uint8)

    def _tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.directory is None:
            return torch.zeros(shape, dtype=dtype).share_memory_()
        size = 1
        for extent in shape:
            size *= extent
        return torch.from_file(str(self.directory / f"{name}.bin"), shared=True, size=size, dtype=dtype).view(shape)

    def hits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.filled[rows].bool()

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[rows], self.targets[rows]

    def write(self, rows: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs[rows] = inputs
        self.targets[rows] = targets
        self.filled[rows] = 1  # last: the data is whole before anyone takes it

    @property
    def size_mb(self) -> float:
        return sum(t.numel() * t.element_size() for t in (self.inputs, self.targets, self.filled)) / 2**20


def _read_layout(directory: Path) -> Any:
    try:
        return json.loads((directory / "layout.json").read_text())
    except (OSError, ValueError):  # missing or unreadable: nothing there can be trusted
        return None


def make_cache(kind: CacheKind, rows: int, sample: tuple[torch.Tensor, torch.Tensor],
               directory: Path | None, source: str = "") -> SampleCache | None:
    if kind == "none":
        return None
    if kind == "disk" and directory is None:
        raise ValueError("a disk cache needs a directory")
    return SampleCache(rows, sample, directory if kind == "disk" else None, source)


class _Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i, transformed (in a worker), from the cache when it holds it."""

    def __init__(self, data: TensorData, transform: Transform | None, cache: CacheKind,
                 cache_dir: Path | None, cache_key: str) -> None:
        self.data, self.transform = data, transform
        self.cache = None
        if transform is not None:  # untransformed in-memory samples are their own cache
            first = (transform(data.inputs[0]), data.targets[0])  # the transformed shape
            self.cache = make_cache(cache, len(data), first, cache_dir, cache_key)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = torch.tensor([index])
        if self.cache is not None and self.cache.hits(row)[0]:
            inputs, targets = self.cache.read(row)
            return inputs[0], targets[0]
        sample, target = self.data.inputs[index], self.data.targets[index]
        if self.transform is not None:
            sample = self.transform(sample)
            if self.cache is not None:
                self.cache.write(row, sample.unsqueeze(0), target.unsqueeze(0))
        return sample, target


class BatchPlan(Protocol):
    """What a ``StreamLoader`` asks of its batch sampler: batches in order, forever, each one's end
    position queued as it is handed out."""

    positions: collections.deque[Position]

    def __iter__(self) -> Iterator[Any]: ...


class _Batches:
    """The ShardLoader's batches as index lists, forever; each batch's end position queued as it goes."""

    def __init__(self, size: int, rank: int, world: int, step_batch: int, seed: int, position: Position,
                 with_epoch: bool = False, shards: Any = None) -> None:
        """``with_epoch``: yield ``(index, epoch)`` pairs, for a Dataset whose items depend on the epoch;
        ``shards``: the shard each sample is read from (``sampler.sample_shards``)."""
        self.shards = shards
        self.size, self.rank, self.world, self.step_batch, self.seed = size, rank, world, step_batch, seed
        self.with_epoch = with_epoch
        self.start = position
        self.positions: collections.deque[Position] = collections.deque()
        self.ids: collections.deque[torch.Tensor] = collections.deque()  # each batch's indices, in order

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        while True:
            indices = shard_indices(self.size, self.rank, self.world, seed=self.seed, epoch=position.epoch,
                                    start=position.offset, shards=self.shards)
            for cursor in range(0, len(indices) - self.step_batch + 1, self.step_batch):
                position = Position(position.epoch, position.offset + self.step_batch * self.world)
                self.positions.append(position)
                chosen = indices[cursor: cursor + self.step_batch]
                self.ids.append(chosen)
                yield [(i, position.epoch) for i in chosen.tolist()] if self.with_epoch else chosen.tolist()
            position = Position(position.epoch + 1, 0)


class StreamLoader:
    """Yields ``(inputs, targets)`` batches of a data set in a batch plan's order from ``workers``
    DataLoader processes (0: in this process) that prefetch ``prefetch`` batches each; ``position`` is
    the one after the batch last returned. The workers stack batches into shared-memory segments they reuse
    once the batch last there is no longer held (``batch_buffers``; ``batch_buffers=False``: a fresh segment
    every batch, as torch does)."""

    def __init__(self, dataset: Dataset[Any], batches: BatchPlan, position: Position, *, workers: int,
                 prefetch: int, pin_memory: bool, collate_fn: Callable[[Any], Any] | None = None,
                 batch_buffers: bool = True) -> None:
        self.position, self.workers, self._batches = position, workers, batches
        self.last_ids: torch.Tensor | None = None  # the data set indices of the batch last returned, if known
        self.last_bad: list[dict[str, Any]] = []  # samples left out of it (--bad-samples skip)
        self.samples = dataset
        self.buffers = BatchBuffers(workers, prefetch) if workers and batch_buffers else None
        if self.buffers is not None:
            collate_fn = self.buffers.collate(collate_fn or default_collate)
        self._loader = DataLoader(dataset, batch_sampler=batches, num_workers=workers,  # type: ignore[arg-type]
                                  prefetch_factor=prefetch if workers else None, persistent_workers=workers > 0,
                                  pin_memory=pin_memory, collate_fn=collate_fn)
        self._iterator = iter(self._loader)

    def __iter__(self) -> StreamLoader:
        return self

    def __next__(self) -> tuple[Any, Any]:
        try:
            batch = next(self._iterator)
        except SampleError as exc:  # raised in a worker: its one line again, without the worker's traceback
            raise SampleError(message_of(exc)) from None
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc):
                raise
            reading = self.samples.in_flight() if isinstance(self.samples, Items) else []
            ids = getattr(self._batches, "ids", None)
            samples = f" while reading sample {reading[0]}" if len(reading) == 1 else \
                f" while reading one of samples {span(reading)}" if reading else \
                f" while loading samples {span(ids[0].tolist())}" if ids else ""
            raise SampleError(f"a data-loading worker process died{samples}: {first_line(exc)}") from None
        if self.buffers is not None:
            batch, slots = batch
            self.buffers.hold(batch, slots)
        inputs, targets, *bad = batch  # a third element: the samples left out (--bad-samples skip)
        self.last_bad = bad[0] if bad else []
        self.position = self._batches.positions.popleft()  # batches come back in the sampler's order
        ids = getattr(self._batches, "ids", None)  # a plan that knows its rows' indices (in-memory data)
        self.last_ids = drop_bad(ids.popleft(), self.last_bad) if ids else None
        return inputs, targets

    def close(self) -> None:
        """Stop the worker processes now (persistent workers stay up while the DataLoader holds its iterator,
        which would be until the garbage collector finds it)."""
        iterator = self.__dict__.pop("_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self._loader._iterator = None


class PipelineLoader(StreamLoader):
    """``ShardLoader``'s batches of an in-memory data set through the input pipeline; ``cache_key``
    names what makes the samples (the task, its options, the dtype), so that a disk cache made for
    anything else is not reused."""

    def __init__(self, data: TensorData, *, rank: int, world: int, step_batch: int, seed: int,
                 position: Position | None = None, workers: int = 0, prefetch: int = 2,
                 transform: Transform | None = None, cache: CacheKind = "none", cache_dir: Path | None = None,
                 cache_key: str = "", pin_memory: bool = False) -> None:
        check_a_batch_fits(len(data), world, step_batch)
        position = position or Position()
        super().__init__(_Samples(data, transform, cache, cache_dir, cache_key),
                         _Batches(len(data), rank, world, step_batch, seed, position), position,
                         workers=workers, prefetch=prefetch, pin_memory=pin_memory)


class DatasetLoader(StreamLoader):
    """``ShardLoader``'s batches of a user's Dataset (``MapData``) through the input pipeline: items read
    (and collated with the task's collate) in ``workers`` DataLoader processes, kept by ``--data-cache``
    when asked (``item_cache``: the items' shapes may differ)."""

    def __init__(self, data: MapData, *, rank: int, world: int, step_batch: int, seed: int,
                 position: Position | None = None, workers: int = 0, prefetch: int = 2,
                 transform: Transform | None = None, cache: CacheKind = "none", cache_dir: Path | None = None,
                 cache_key: str = "", pin_memory: bool = False, batch_buffers: bool = True) -> None:
        check_a_batch_fits(len(data), world, step_batch)
        position = position or Position()
        if cache != "none" and data.per_epoch:
            raise UsageError(f"bad value data-cache={cache!r}: this Dataset's items change with the epoch "
                             "(item_for_epoch: its augmentation), so they cannot be kept by index")
        self.cache = make_item_cache(cache, cache_dir, cache_key)
        batches = _Batches(len(data), rank, world, step_batch, seed, position, with_epoch=data.per_epoch,
                           shards=sample_shards(data))
        super().__init__(Items(data, self.cache), batches,
                         position, workers=workers, prefetch=prefetch, pin_memory=pin_memory,
                         collate_fn=CollateIndexed(data), batch_buffers=batch_buffers)

    def close(self) -> None:
        super().close()
        if self.cache is not None:
            self.cache.close()


MIN_TIMING_S = 0.25  # --data-workers auto: the least time each candidate is timed for
MAX_TIMED = 256  # ... and the most batches


def autotune_workers(make: Callable[[int], StreamLoader], batches: int = 8,
                     prefetch: int = 2) -> tuple[int, dict[int, float]]:
    """``--data-workers auto``: the number of workers (0, 1, 2, 4, ... up to the CPUs) whose loader delivers
    batches fastest in its steady state. Each candidate first fills its pipeline (``workers x prefetch``
    batches: every worker started and its queue drawn down, so that batches made during the others' start-up
    do not count as speed), then is timed over at least ``max(batches, 2 x workers)`` batches and at least
    ``MIN_TIMING_S`` (up to ``MAX_TIMED`` batches): on a 16-core host, timing 8 batches after the first
    picked 8 workers where 16 were 1.5x faster, and batches of a few milliseconds need more of them than a
    few dozen to tell 8 workers from 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    candidates = [0, *[n for n in (1, 2, 4, 8, 16) if n <= cpus]]
    timings: dict[int, float] = {}
    for workers in candidates:
        loader = make(workers)
        for _ in range(max(1, workers * prefetch)):
            next(loader)
        least, timed = max(batches, 2 * workers), 0
        start = time.perf_counter()
        while timed < least or (time.perf_counter() - start < MIN_TIMING_S and timed < MAX_TIMED):
            next(loader)
            timed += 1
        timings[workers] = (time.perf_counter() - start) / timed * 1e3
        loader.close()
    best = min(timings, key=lambda n: (timings[n], n))
    return best, timings


def describe_choice(best: int, timings: dict[int, float]) -> str:
    measured = ", ".join(f"{n}: {ms:.1f}" for n, ms in timings.items())
    return f"mlscale: --data-workers auto picked {best} (ms per batch by workers: {measured})"


__all__ = ["DatasetLoader", "PipelineLoader", "SampleCache", "StreamLoader", "autotune_workers", "describe_choice",
           "make_cache"]
