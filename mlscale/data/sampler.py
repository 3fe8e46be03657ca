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

*Data stored in shards* (tar files, Parquet row groups: a Dataset that says which shard each sample is read
from, ``sample_shards()``) gets an order of the same kind, a permutation drawn from ``(seed, epoch)``, laid out
so that a rank reads only its own shards (``shard_order``). The shards, in an order drawn from the seed, are
cut into ``PARTITIONS`` pieces of equal size (a piece is a run of whole shards, but for the shard where it is
cut); position ``p`` of the epoch reads piece ``p % PARTITIONS``, so for any world size dividing
``PARTITIONS`` a rank reads the pieces of one residue class: its shards, and the same ones every epoch (a
cache of them is read again, not refetched). Within a piece, each epoch reads its shards in a new order and
each shard's samples shuffled. The ``size % PARTITIONS`` samples left over open the epoch. Every property
above still holds, at any world size; at a world size that does not divide ``PARTITIONS`` a rank reads some
of the others' shards too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler

from mlscale.errors import UsageError

PARTITIONS = 24  # pieces of a sharded data set's order: world sizes 1, 2, 3, 4, 6, 8, 12 and 24 read their own


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True, shards: np.ndarray | None = None
                ) -> torch.Tensor:
    """The global order of sample indices for one epoch; a pure function of its arguments. ``shards``:
    the shard each sample is read from (``shard_order``)."""
    if not shuffle:
        return torch.arange(size)
    if shards is not None:
        return shard_order(shards, seed, epoch)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shard_order(shards: np.ndarray, seed: int, epoch: int, partitions: int = PARTITIONS) -> torch.Tensor:
    """The epoch order of samples stored in shards (``shards[i]``: sample ``i``'s shard), laid out so that
    position ``p`` reads piece ``p % partitions`` of the shards (the module's docstring)."""
    size = len(shards)
    _, shard_of = np.unique(np.asarray(shards), return_inverse=True)
    shard_count = int(shard_of.max()) + 1 if size else 0
    seed = seed % 2**63
    placed = np.random.default_rng([seed, 0x5A4D]).permutation(shard_count)  # each shard's place, all epochs
    sequence = np.lexsort((np.arange(size), placed[shard_of]))  # shard by shard, each in its stored order
    length = size // partitions
    pieces = sequence[: partitions * length].reshape(partitions, length)
    left_over = sequence[partitions * length:]
    draws = np.random.default_rng([seed, epoch, 0x5A4E])
    shard_key, sample_key = draws.random(shard_count), draws.random(size)
    within = np.lexsort((sample_key[pieces], shard_key[shard_of[pieces]]), axis=-1)  # shards, then samples
    pieces = np.take_along_axis(pieces, within, axis=1)
    order = np.concatenate([left_over[draws.permutation(len(left_over))], pieces.T.reshape(-1)])
    return torch.from_numpy(order.astype(np.int64))


def shard_indices(
    size: int, rank: int, world: int, *, seed: int, epoch: int, start: int = 0,
    drop_last: bool = True, shuffle: bool = True, shards: np.ndarray | None = None,
) -> torch.Tensor:
    """The indices rank ``rank`` of ``world`` reads in ``epoch``, from global offset ``start`` on; ``shards``:
    the shard each sample is read from, for data stored in shards (``shard_order``)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    if not 0 <= start <= size:
        raise ValueError(f"start {start} is outside the data set of {size} samples")
    remaining = epoch_order(size, seed, epoch, shuffle, shards)[start:]
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
    shards: np.ndarray | None = None

    def _indices(self) -> torch.Tensor:
        return shard_indices(self.size, self.rank, self.world, seed=self.seed, epoch=self.epoch,
                             start=self.start, drop_last=self.drop_last, shuffle=self.shuffle, shards=self.shards)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices().tolist())

    def __len__(self) -> int:
        return len(self._indices())

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start


def sample_shards(data: object) -> np.ndarray | None:
    """The shard each sample of ``data`` is read from, when it says (a Dataset's ``sample_shards()``, also
    through ``MapData``); None for data held in memory."""
    dataset = getattr(data, "dataset", data)
    method = getattr(dataset, "sample_shards", None)
    if not callable(method):
        return None
    shards = np.asarray(method())
    if shards.shape != (len(dataset),):  # type: ignore[arg-type]
        raise UsageError(f"{type(dataset).__name__}.sample_shards() gives {shards.shape[0] if shards.ndim else 0} "
                         f"values for {len(dataset):,} samples; one shard number a sample")  # type: ignore[arg-type]
    return shards
