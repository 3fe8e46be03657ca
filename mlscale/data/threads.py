"""``--data-threads T``: a Dataset's items read by T threads of the training process instead of worker processes.

Where ``__getitem__`` spends its time in code that releases the GIL (Pillow's JPEG decoding and resizing,
reading files, tokenizers in Rust), threads run in parallel like processes, without a process's start-up,
its copy of the Dataset, or the pickling of every batch back to the training process. Pure-Python
``__getitem__`` code holds the GIL and gains nothing: ``mlscale bench data --suite images`` measures both.

The batches are the same as every other loader's (``pipeline._Batches``: the shard of the epoch order from an
exact position); each item is one task on the pool, ``prefetch`` batches in flight, and a batch is collated
in the training process when it is next, so the batches come back in order and the position after each is
exact.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mlscale.data.dataset import CollateIndexed, Items, MapData
from mlscale.data.loader import Position, check_a_batch_fits, drop_bad
from mlscale.data.pipeline import StreamLoader, _Batches
from mlscale.data.sampler import sample_shards


class ThreadLoader(StreamLoader):
    """``ShardLoader``'s batches of a Dataset, items read by ``threads`` threads, ``prefetch`` batches ahead."""

    def __init__(self, data: MapData, *, rank: int, world: int, step_batch: int, seed: int,
                 position: Position | None = None, threads: int = 2, prefetch: int = 2) -> None:
        check_a_batch_fits(len(data), world, step_batch)
        self.position = position or Position()
        self.workers = 0  # no worker processes
        self.threads = threads
        self._batches = _Batches(len(data), rank, world, step_batch, seed, self.position, with_epoch=data.per_epoch,
                                 shards=sample_shards(data))
        self._plan = iter(self._batches)
        self.samples = Items(data)
        self._collate = CollateIndexed(data)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mlscale-data")
        self._in_flight: collections.deque[list[Future[Any]]] = collections.deque()
        self.last_ids = None
        self.last_bad: list[dict[str, Any]] = []
        for _ in range(prefetch):
            self._submit()

    def _submit(self) -> None:
        keys = next(self._plan)
        self._in_flight.append([self._pool.submit(self.samples.__getitem__, key) for key in keys])

    def __next__(self) -> tuple[Any, Any]:
        self._submit()  # the next batch's items start before this one is collated
        batch = self._collate([future.result() for future in self._in_flight.popleft()])
        inputs, targets, *bad = batch
        self.last_bad = bad[0] if bad else []
        self.position = self._batches.positions.popleft()
        self.last_ids = drop_bad(self._batches.ids.popleft(), self.last_bad)
        return inputs, targets

    def close(self) -> None:
        for batch in self._in_flight:
            for future in batch:
                future.cancel()
        self._in_flight.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["ThreadLoader"]
