"""A batch iterator over an in-memory data set that knows its exact position.

The position ``(epoch, offset)`` is the global number of samples consumed in the current epoch;
restoring it resumes the same stream of batches, also with another number of workers. Incomplete
batches at the end of an epoch are dropped so that every step has the same global batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlscale.data.sampler import sample_shards, shard_indices
from mlscale.data.tensors import TensorData
from mlscale.errors import UsageError

if TYPE_CHECKING:
    from mlscale.data.dataset import MapData


@dataclass
class Position:
    epoch: int = 0
    offset: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def steps_per_epoch(size: int, world: int, step_batch: int) -> int:
    return (size // world) // step_batch


def check_a_batch_fits(size: int, world: int, step_batch: int, source: str = "the data set") -> None:
    """Refuse, in one line naming ``--batch-size``, shards too small to give every worker one batch an
    epoch: the one check of it, made by the job's plan before any process starts and by the loaders."""
    if steps_per_epoch(size, world, step_batch) == 0:
        raise UsageError(f"bad value batch-size={step_batch}: {step_batch} per worker x {world} worker(s) is more "
                         f"than the {size:,} training samples of {source}")


def drop_bad(ids: torch.Tensor, bad: list[dict[str, Any]]) -> torch.Tensor:
    """A batch's indices without the samples left out of it."""
    if not bad:
        return ids
    left_out = {note["index"] for note in bad}
    return ids[torch.tensor([int(i) not in left_out for i in ids], dtype=torch.bool)]


class ShardLoader:
    """Yields ``(inputs, targets)`` batches of this rank's shard, epoch after epoch, forever, in this
    process: rows of in-memory tensors, or a user's Dataset's items collated (``MapData``)."""

    def __init__(self, data: TensorData | MapData, *, rank: int, world: int, step_batch: int, seed: int,
                 position: Position | None = None) -> None:
        check_a_batch_fits(len(data), world, step_batch)
        self.data, self.rank, self.world = data, rank, world
        self.step_batch, self.seed = step_batch, seed
        self.position = position or Position()
        self.shards = sample_shards(data)  # data stored in shards: an order that keeps a rank on its own
        self.last_ids: torch.Tensor | None = None  # the data set indices of the batch last returned
        self.last_bad: list[dict[str, Any]] = []  # samples left out of it (a Dataset under --bad-samples skip)
        self._load_epoch()

    def _load_epoch(self) -> None:
        self._indices = shard_indices(len(self.data), self.rank, self.world, seed=self.seed,
                                      epoch=self.position.epoch, start=self.position.offset, shards=self.shards)
        self._cursor = 0

    def __iter__(self) -> ShardLoader:
        return self

    def __next__(self) -> tuple[Any, Any]:
        if self._cursor + self.step_batch > len(self._indices):
            self.position = Position(self.position.epoch + 1, 0)
            self._load_epoch()
        idx = self._indices[self._cursor: self._cursor + self.step_batch]
        self._cursor += self.step_batch
        self.position = Position(self.position.epoch, self.position.offset + self.step_batch * self.world)
        noted = len(getattr(self.data, "bad", ()))
        batch = self.data.batch(idx, self.position.epoch)
        self.last_bad = list(getattr(self.data, "bad", [])[noted:])
        self.last_ids = drop_bad(idx, self.last_bad)
        return batch
