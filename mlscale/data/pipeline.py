"""The input pipeline: torch's DataLoader (worker processes, prefetch, pinned memory) over the same
batches as ``ShardLoader``, with a per-sample transform and a cache, at the same exact position.

The batches are the ``ShardLoader``'s: this rank's shard of the epoch order, from a position on. The
DataLoader's batch sampler runs in this process and hands each batch's indices to the workers in
order; it records the position after each batch as it goes, and the batches come back in that order,
so the position of the batch just returned is always known: a resume mid-epoch reads exactly the
rest of the epoch, with or without workers, also at another world size.

The transform (``Task.transform``) runs per sample in the workers: the parallel map. The cache holds
transformed samples in shared memory, filled as the first epoch reads them, so later epochs skip the
transform (for deterministic transforms only: the task says so by declaring one).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from mlscale.data.loader import Position, steps_per_epoch
from mlscale.data.sampler import shard_indices
from mlscale.tasks.base import TensorData

Transform = Callable[[torch.Tensor], torch.Tensor]


class _Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i, transformed (in a worker), from the shared cache when it is filled."""

    def __init__(self, data: TensorData, transform: Transform | None, cache: bool) -> None:
        self.data, self.transform = data, transform
        self.cache: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None
        if cache and transform is not None:
            shape = transform(data.inputs[0]).shape  # the transformed shape, from the first sample
            self.cache = torch.empty((len(data), *shape), dtype=data.inputs.dtype).share_memory_()
            self.filled = torch.zeros(len(data), dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cache is not None and self.filled[index]:
            return self.cache[index], self.data.targets[index]
        sample = self.data.inputs[index]
        if self.transform is not None:
            sample = self.transform(sample)
            if self.cache is not None:
                self.cache[index] = sample
                self.filled[index] = True
        return sample, self.data.targets[index]


class _Batches:
    """The ShardLoader's batches as index lists, forever; each batch's end position queued as it goes."""

    def __init__(self, size: int, rank: int, world: int, batch_size: int, seed: int, position: Position) -> None:
        self.size, self.rank, self.world, self.batch_size, self.seed = size, rank, world, batch_size, seed
        self.start = position
        self.positions: collections.deque[Position] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        while True:
            indices = shard_indices(self.size, self.rank, self.world, seed=self.seed, epoch=position.epoch,
                                    start=position.offset)
            for cursor in range(0, len(indices) - self.batch_size + 1, self.batch_size):
                position = Position(position.epoch, position.offset + self.batch_size * self.world)
                self.positions.append(position)
                yield indices[cursor: cursor + self.batch_size].tolist()
            position = Position(position.epoch + 1, 0)


class PipelineLoader:
    """Yields ``(inputs, targets)`` batches like ``ShardLoader``, from ``workers`` DataLoader processes
    (0: in this process) that prefetch ``prefetch`` batches each; ``position`` is the one after the
    batch last returned."""

    def __init__(self, data: TensorData, *, rank: int, world: int, batch_size: int, seed: int,
                 position: Position | None = None, workers: int = 0, prefetch: int = 2,
                 transform: Transform | None = None, cache: bool = False, pin_memory: bool = False) -> None:
        if steps_per_epoch(len(data), world, batch_size) == 0:
            raise ValueError(
                f"batch size {batch_size} x {world} workers is larger than the data set ({len(data)} samples)")
        self.position = position or Position()
        self.workers = workers
        self._batches = _Batches(len(data), rank, world, batch_size, seed, self.position)
        self.samples = _Samples(data, transform, cache)
        self._loader = DataLoader(self.samples, batch_sampler=self._batches, num_workers=workers,
                                  prefetch_factor=prefetch if workers else None, persistent_workers=workers > 0,
                                  pin_memory=pin_memory)
        self._iterator = iter(self._loader)

    def __iter__(self) -> PipelineLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = next(self._iterator)
        self.position = self._batches.positions.popleft()  # batches come back in the sampler's order
        return inputs, targets

    def close(self) -> None:
        del self._iterator  # stops the worker processes


def autotune_workers(make: Callable[[int], PipelineLoader], batches: int = 8) -> tuple[int, dict[int, float]]:
    """``--data-workers auto``: the number of workers (0, 1, 2, 4, ... up to the CPUs) whose loader
    delivers ``batches`` batches fastest, measured after each one's first batch (the start-up)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    candidates = [0, *[n for n in (1, 2, 4, 8, 16) if n <= cpus]]
    timings: dict[int, float] = {}
    for workers in candidates:
        loader = make(workers)
        next(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        timings[workers] = (time.perf_counter() - start) / batches * 1e3
        loader.close()
    best = min(timings, key=lambda n: (timings[n], n))
    return best, timings


def describe_choice(best: int, timings: dict[int, float]) -> str:
    measured = ", ".join(f"{n}: {ms:.1f}" for n, ms in timings.items())
    return f"mlscale: --data-workers auto picked {best} (ms per batch by workers: {measured})"


__all__ = ["PipelineLoader", "autotune_workers", "describe_choice"]
