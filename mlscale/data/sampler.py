"""Deterministic, balanced, resumable sharding of a data set over workers.

Each epoch has one global order, a permutation drawn from ``(seed, epoch)`` alone. A position in the
epoch is a *global* offset into that order (samples consumed by all workers together), so a run can
resume in the middle of an epoch, also with a different number of workers: the rest of the order is
sharded again over the new world. Rank ``r`` takes every ``world``-th index of the remaining order,
starting at ``r``. Consequences, tested as properties:

- shards are disjoint and together cover the remaining order (all of it, or all but fewer than
  ``world`` samples with ``drop_last``);
- shard sizes differ by at most one (exactly equal with ``drop_last``);
- step ``s`` of ``world`` workers with batch ``B`` reads exactly the samples that step ``s`` of one
  worker with batch ``world * B`` reads, which is what makes N-worker training equal 1-worker training.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of sample indices for one epoch; a pure function of its arguments."""
    if not shuffle:
        return torch.arange(size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shard_indices(
    size: int, rank: int, world: int, *, seed: int, epoch: int, start: int = 0,
    drop_last: bool = True, shuffle: bool = True,
) -> torch.Tensor:
    """The indices rank ``rank`` of ``world`` reads in ``epoch``, from global offset ``start`` on."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    if not 0 <= start <= size:
        raise ValueError(f"start {start} is outside the data set of {size} samples")
    remaining = epoch_order(size, seed, epoch, shuffle)[start:]
    if drop_last:
        remaining = remaining[: len(remaining) - len(remaining) % world]
    return remaining[rank::world]


@dataclass
class ShardedSampler(Sampler[int]):
    """A ``torch.utils.data.Sampler`` over ``shard_indices``, for use with a ``DataLoader``."""

    size: int
    rank: int
    world: int
    seed: int = 0
    epoch: int = 0
    start: int = 0
    drop_last: bool = True
    shuffle: bool = True

    def _indices(self) -> torch.Tensor:
        return shard_indices(self.size, self.rank, self.world, seed=self.seed, epoch=self.epoch,
                             start=self.start, drop_last=self.drop_last, shuffle=self.shuffle)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices().tolist())

    def __len__(self) -> int:
        return len(self._indices())

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
