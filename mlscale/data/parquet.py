"""Parquet data sets (what Spark, Dask and pandas write), streamed a row group at a time and sharded
over the data-parallel workers by row group, so that the data set need not fit in memory.

The row groups, in an order drawn from the seed, are dealt one by one to the worker with the fewest
rows so far (ties: the lower rank): each worker owns its row groups for the whole run, reads only
those, and the workers' rows differ by at most one row group. Each epoch a worker reads its groups in
an order drawn from ``(seed, epoch, rank)``, in windows of ``window`` groups whose rows are shuffled
together (a shuffle buffer of ``window`` row groups), in batches; the epoch ends when the rows of the
worker with the fewest are used up, and every worker stops there, so that every step has the same
global batch (the others' last rows that epoch are not trained on: another part of them each epoch).

A position is the ``Position`` of in-memory data: the epoch and the global number of samples
consumed in it (every worker consumes the same number). A resume at the same number of workers
reads exactly the rest of the epoch, also with another batch size. The deal depends on the number of
workers, so a mid-epoch resume at another number is refused (at an epoch boundary any number is fine).

Rows stay in Parquet until a batch needs them. A process keeps the row groups of two windows decoded;
with DataLoader workers, each decodes the groups of the batches it builds, so a window's groups are
decoded once per DataLoader worker (the transform runs once per sample). With a cache
(``--data-cache memory|disk``), the worker's decoded and transformed samples are kept by row, so
epochs after the first neither decode nor transform; the disk cache is how a data set larger than
memory is decoded once.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mlscale.data.loader import Position, steps_per_epoch
from mlscale.data.pipeline import CacheKind, StreamLoader, Transform, make_cache
from mlscale.data.sampler import epoch_order
from mlscale.data.tensors import TensorData
from mlscale.errors import UsageError


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("Parquet data needs pyarrow: pip install 'mlscale[parquet]'") from None
    return pq


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file; ``first_row`` is the data set's id of its first row (in file order)."""

    file: str
    index: int
    rows: int
    first_row: int


def find_files(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """The Parquet files of a directory (every ``*.parquet`` below it, as Spark and Dask write them),
    a glob, a file, or a list of those; sorted, so that the data set has one order."""
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    files: list[Path] = []
    for item in sources:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.parquet") if p.is_file())
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(str(item), recursive=True) if Path(p).is_file())
        if not found:
            raise UsageError(f"bad value data={str(item)!r}: no Parquet files there")
        files.extend(found)
    return files


class ParquetData:
    """Feature columns (numbers, or fixed-length lists of numbers, concatenated in the order given)
    and a target column, read from Parquet one row group at a time. Integer targets are class labels
    (int64); floating ones are regression targets in the feature dtype."""

    def __init__(self, source: str | Path | Sequence[str | Path], *, target: str,
                 features: Sequence[str] | None = None, dtype: torch.dtype = torch.float32,
                 groups: Sequence[RowGroup] | None = None) -> None:
        pq = _pyarrow()
        self.dtype = dtype
        self.files = find_files(source)
        _, names = self._footer(pq, self.files[0])
        if target not in names:
            raise UsageError(f"bad value target={target!r}: {self.files[0]} has no such column "
                             f"(columns: {', '.join(names)})")
        self.target = target
        self.features = list(features) if features else [name for name in names if name != target]
        missing = [name for name in self.features if name not in names]
        if missing or not self.features:
            raise UsageError(f"bad value features={','.join(missing) or '(none)'}: not columns of {self.files[0]} "
                             f"(columns: {', '.join(names)})")
        self.groups = list(groups) if groups is not None else self._row_groups(pq)

    @staticmethod
    def _footer(pq: Any, path: Path) -> tuple[Any, list[str]]:
        """A file's metadata and column names, read once; a file pyarrow cannot read is one line."""
        try:
            file = pq.ParquetFile(path)
            return file.metadata, list(file.schema_arrow.names)
        except Exception as exc:  # pyarrow's ArrowInvalid and OSError both mean: cannot be read as Parquet
            raise UsageError(f"bad value data={str(path)!r}: not a readable Parquet file ({exc})") from None

    def _row_groups(self, pq: Any) -> list[RowGroup]:
        groups, first = [], 0
        for path in self.files:
            metadata, columns = self._footer(pq, path)
            names = set(columns)
            if not {self.target, *self.features} <= names:
                missing = sorted({self.target, *self.features} - names)
                raise UsageError(f"bad value data={str(path)!r}: lacks the column(s) {', '.join(missing)} "
                                 f"that {self.files[0].name} has")
            for index in range(metadata.num_row_groups):
                rows = metadata.row_group(index).num_rows
                if rows:
                    groups.append(RowGroup(str(path), index, rows, first))
                    first += rows
        if not groups:
            raise UsageError(f"bad value data={str(self.files[0].parent)!r}: the Parquet files hold no rows")
        return groups

    def __len__(self) -> int:
        return sum(group.rows for group in self.groups)

    def to(self, dtype: torch.dtype) -> ParquetData:
        copy = object.__new__(ParquetData)
        copy.__dict__.update(self.__dict__, dtype=dtype)
        return copy

    def subset(self, groups: Sequence[RowGroup]) -> ParquetData:
        copy = self.to(self.dtype)
        copy.groups = list(groups)
        return copy

    def read(self, group: RowGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The row group's features ``[rows, F]`` and targets ``[rows, ...]``, decoded."""
        table = _pyarrow().ParquetFile(group.file).read_row_group(group.index, columns=[*self.features, self.target])
        where = f"row group {group.index} of {group.file}"
        inputs = torch.cat([self._column(table.column(name), name, where).reshape(group.rows, -1)
                            for name in self.features], dim=1).to(self.dtype)
        targets = self._column(table.column(self.target), self.target, where)
        targets = targets.long() if not targets.is_floating_point() else targets.to(self.dtype)
        return inputs, targets

    @staticmethod
    def _column(column: Any, name: str, where: str) -> torch.Tensor:
        import pyarrow as pa
        import pyarrow.compute as pc

        if column.null_count:
            raise UsageError(f"bad data: column {name!r} has {column.null_count} null(s) in {where}; fill or drop "
                             "them before training")
        column = column.combine_chunks()
        kind = column.type
        if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
            lengths = set(pc.list_value_length(column).to_numpy().tolist())
            if len(lengths) != 1:
                raise UsageError(f"bad data: column {name!r} holds lists of lengths {sorted(lengths)[:4]} in {where}; "
                                 "a feature list must have one length")
            values = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), lengths.pop())
        elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            values = column.to_numpy(zero_copy_only=False)
        else:
            raise UsageError(f"bad data: column {name!r} is {kind}; features and targets must be numbers or "
                             "lists of numbers")
        if values.dtype == np.bool_:
            values = values.astype(np.uint8)
        return torch.from_numpy(np.require(values, requirements=["C", "W"]))

    def column_max(self, name: str) -> int:
        """The largest value of an integer column, from the files' statistics where they have them."""
        pq, largest = _pyarrow(), None
        for group in self.groups:
            file = pq.ParquetFile(group.file)
            stats = file.metadata.row_group(group.index).column(file.metadata.schema.names.index(name)).statistics
            if stats is not None and stats.has_min_max:
                value = int(stats.max)
            else:  # no statistics written: read the column of this row group
                value = int(file.read_row_group(group.index, columns=[name]).column(name).to_numpy().max())
            largest = value if largest is None else max(largest, value)
        assert largest is not None
        return largest

    def head(self, rows: int) -> TensorData:
        """The first ``rows`` rows (in file order) in memory."""
        inputs, targets, have = [], [], 0
        for group in self.groups:
            if have >= rows:
                break
            x, y = self.read(group)
            inputs.append(x)
            targets.append(y)
            have += len(x)
        return TensorData(torch.cat(inputs)[:rows], torch.cat(targets)[:rows])

    def fingerprint(self, digest: Any) -> None:
        """Feed what identifies the rows read to ``digest``: each file's size and Parquet footer (its
        schema, row groups, column chunks' offsets, sizes and statistics), which row groups and which
        columns. The footer, not every byte: a fingerprint must not cost another pass over the data."""
        digest.update(f"parquet:{self.features}:{self.target}".encode())
        for path in sorted({group.file for group in self.groups}):
            with open(path, "rb") as handle:
                size = handle.seek(0, 2)
                handle.seek(size - 8)
                footer_length = int.from_bytes(handle.read(4), "little")
                handle.seek(max(0, size - 8 - footer_length))
                digest.update(f"{Path(path).name}:{size}:".encode())
                digest.update(handle.read(footer_length))
        digest.update(str([(Path(g.file).name, g.index) for g in self.groups]).encode())

    def identity(self) -> str:
        """What the rows are, cheaply, for a cache to tell whether it still holds them (no file is
        opened): the files (name, size, modification time) and the columns. ``fingerprint`` is for
        lineage: what the files hold (their footers)."""
        files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in self.files]
        return f"{files}:{self.features}:{self.target}"

    def describe(self) -> str:
        return (f"{len(self.files)} Parquet file(s), {len(self.groups)} row groups, {len(self):,} rows, "
                f"{len(self.features)} feature column(s) -> {self.target!r}")


def deal_row_groups(rows: Sequence[int], world: int, seed: int) -> list[list[int]]:
    """The row groups (by position in ``rows``) each of ``world`` workers owns: in the seed's order,
    each to the worker with the fewest rows so far (ties: the lower rank), which keeps the workers
    within one row group of each other."""
    plan: list[list[int]] = [[] for _ in range(world)]
    emptiest = [(0, worker) for worker in range(world)]
    for group in epoch_order(len(rows), seed, 0).tolist():
        load, worker = heapq.heappop(emptiest)
        plan[worker].append(group)
        heapq.heappush(emptiest, (load + rows[group], worker))
    return plan


def epoch_rows(rows: Sequence[int], world: int, seed: int) -> int:
    """Rows each worker trains on per epoch: those of the worker with the fewest."""
    return min(sum(rows[g] for g in groups) for groups in deal_row_groups(rows, world, seed))


def epoch_steps_for(data: TensorData | ParquetData, world: int, step_batch: int, seed: int) -> int:
    if isinstance(data, ParquetData):
        return epoch_rows([group.rows for group in data.groups], world, seed) // step_batch
    return steps_per_epoch(len(data), world, step_batch)


def check_resumable(data: TensorData | ParquetData, position: Position, saved_world: int, world: int) -> None:
    """A mid-epoch position of Parquet data holds only at the number of workers it was dealt to."""
    if isinstance(data, ParquetData) and position.offset and saved_world != world:
        raise UsageError(f"cannot resume Parquet data mid-epoch (epoch {position.epoch}, {position.offset:,} samples "
                         f"in) on {world} data-parallel workers: its row groups were dealt to {saved_world}; "
                         f"resume with {saved_world}, or from a checkpoint at an epoch boundary")


def check_shardable(data: ParquetData, world: int, step_batch: int, seed: int) -> None:
    """Refuse, in one line, a data set that cannot give every worker a batch in every epoch."""
    rows = [group.rows for group in data.groups]
    if len(rows) < world:
        raise UsageError(f"bad value workers={world}: the Parquet data has {len(rows)} row group(s) and every "
                         "worker reads whole row groups; write smaller row groups (row_group_size) or use fewer "
                         "workers")
    fewest = epoch_rows(rows, world, seed)
    if fewest < step_batch:
        raise UsageError(f"bad value batch-size={step_batch}: the {len(rows)} row groups dealt to {world} workers "
                         f"leave one with {fewest:,} rows, less than a batch; write smaller row groups or use a "
                         "smaller batch")


def _mixed_seed(*parts: int) -> int:
    """A generator seed from several numbers, without overflow for any seed."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


class _ParquetBatches:
    """Batches of one worker's stream as ``[B, 2]`` tensors of (row group, row in group), forever;
    each batch's end position queued as it goes. Only indices: the rows are read by the dataset."""

    def __init__(self, data: ParquetData, rank: int, world: int, step_batch: int, seed: int, window: int,
                 position: Position) -> None:
        self.rows = [group.rows for group in data.groups]
        plan = deal_row_groups(self.rows, world, seed)
        self.groups = plan[rank]
        self.epoch_rows = min(sum(self.rows[g] for g in groups) for groups in plan)
        self.rank, self.world, self.step_batch, self.seed, self.window = rank, world, step_batch, seed, window
        self.start = position
        self.positions: collections.deque[Position] = collections.deque()

    def _stream(self, epoch: int) -> Iterator[torch.Tensor]:
        """This worker's epoch, window by window: ``[rows, 2]`` (group, row) in shuffled order."""
        order = torch.Generator().manual_seed(_mixed_seed(self.seed, epoch, self.rank))
        groups = [self.groups[i] for i in torch.randperm(len(self.groups), generator=order).tolist()]
        for start in range(0, len(groups), self.window):
            window = groups[start: start + self.window]
            pairs = torch.cat([torch.stack([torch.full((self.rows[g],), g), torch.arange(self.rows[g])], dim=1)
                               for g in window])
            shuffle = torch.Generator().manual_seed(_mixed_seed(self.seed, epoch, self.rank, start))
            yield pairs[torch.randperm(len(pairs), generator=shuffle)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        position, batch = self.start, self.step_batch
        while True:
            consumed = position.offset // self.world  # rows of this worker trained on in this epoch
            skip, pending = consumed, torch.empty((0, 2), dtype=torch.int64)
            for pairs in self._stream(position.epoch):
                if consumed + batch > self.epoch_rows:
                    break
                if skip >= len(pairs):
                    skip -= len(pairs)
                    continue
                pending, skip = torch.cat([pending, pairs[skip:]]), 0
                while len(pending) >= batch and consumed + batch <= self.epoch_rows:
                    taken, pending = pending[:batch], pending[batch:]
                    consumed += batch
                    position = Position(position.epoch, consumed * self.world)
                    self.positions.append(position)
                    yield taken
            position = Position(position.epoch + 1, 0)


class _ParquetRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The rows a batch names, decoded from their row groups (the last ``keep`` kept decoded),
    transformed, and cached by this worker's row (``own``: its row groups)."""

    def __init__(self, data: ParquetData, own: Sequence[int], transform: Transform | None, cache: CacheKind,
                 cache_dir: Path | None, cache_key: str, keep: int) -> None:
        self.data, self.transform, self.keep = data, transform, keep
        self.slots = torch.full((len(data.groups),), -1, dtype=torch.int64)  # a row's cache slot: base + row
        base = 0
        for group in own:
            self.slots[group] = base
            base += data.groups[group].rows
        self._decoded: collections.OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self._shape: tuple[torch.Size, torch.dtype] | None = None
        self.cache = None
        if cache != "none":
            inputs, targets = self._group(own[0])
            first = (self._transform(inputs[:1])[0], targets[0])
            self.cache = make_cache(cache, base, first, cache_dir, source=f"{cache_key}:{data.identity()}:{own}")
            self._decoded.clear()

    def __len__(self) -> int:
        return len(self.data)

    def _group(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index in self._decoded:
            self._decoded.move_to_end(index)
        else:
            inputs, targets = self.data.read(self.data.groups[index])
            shape = (inputs.shape[1:], targets.dtype)
            if self._shape is None:
                self._shape = shape
            elif shape != self._shape:
                group = self.data.groups[index]
                raise UsageError(f"bad data: row group {group.index} of {group.file} has features of shape "
                                 f"{list(shape[0])} and {shape[1]} targets, others {list(self._shape[0])} and "
                                 f"{self._shape[1]}; every file must have the same columns and types")
            self._decoded[index] = inputs, targets
            while len(self._decoded) > self.keep:
                self._decoded.popitem(last=False)
        return self._decoded[index]

    def _transform(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs if self.transform is None else torch.stack([self.transform(x) for x in inputs])

    def __getitems__(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups, rows = batch[:, 0], batch[:, 1]
        if self.cache is None:
            inputs, targets = self._decode(groups, rows)
            return self._transform(inputs), targets
        slots = self.slots[groups] + rows
        missing = (~self.cache.hits(slots)).nonzero().flatten()
        if len(missing):
            inputs, targets = self._decode(groups[missing], rows[missing])
            self.cache.write(slots[missing], self._transform(inputs), targets)
        return self.cache.read(slots)

    def _decode(self, groups: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows, in the order given, from their (decoded) row groups."""
        inputs: torch.Tensor | None = None
        targets: torch.Tensor | None = None
        for group in groups.unique().tolist():
            where = (groups == group).nonzero().flatten()
            x, y = self._group(group)
            if inputs is None or targets is None:
                inputs = x.new_empty((len(groups), *x.shape[1:]))
                targets = y.new_empty((len(groups), *y.shape[1:]))
            inputs[where], targets[where] = x[rows[where]], y[rows[where]]
        assert inputs is not None and targets is not None
        return inputs, targets


def _as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # the dataset builds whole batches


class ParquetLoader(StreamLoader):
    """Batches of this worker's row groups through the input pipeline (see the module's docstring).
    ``cache_key`` names what else makes the samples (the task, its options, the dtype): a disk cache
    made for anything else is not reused."""

    def __init__(self, data: ParquetData, *, rank: int, world: int, step_batch: int, seed: int,
                 position: Position | None = None, workers: int = 0, prefetch: int = 2,
                 transform: Transform | None = None, cache: CacheKind = "none", cache_dir: Path | None = None,
                 cache_key: str = "", pin_memory: bool = False, window: int = 4) -> None:
        check_shardable(data, world, step_batch, seed)
        position = position or Position()
        batches = _ParquetBatches(data, rank, world, step_batch, seed, window, position)
        # A batch near a window's end takes rows of the next window too: two windows stay decoded.
        rows = _ParquetRows(data, batches.groups, transform, cache, cache_dir, cache_key, keep=2 * window)
        super().__init__(rows, batches, position, workers=workers, prefetch=prefetch, pin_memory=pin_memory,
                         collate_fn=_as_batch)


def write_parquet(data: TensorData, directory: str | Path, *, files: int = 4, row_group_rows: int = 128,
                  target: str = "label") -> list[Path]:
    """Write an in-memory data set as ``files`` Parquet files of ``row_group_rows``-row groups, one
    scalar column per feature (``x0``, ``x1``, ...) and the target, as pandas or Spark would."""
    import pyarrow as pa
    pq = _pyarrow()

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    inputs = data.inputs.reshape(len(data), -1).numpy()
    written = []
    for part, rows in enumerate(np.array_split(np.arange(len(data)), files)):
        columns = {f"x{i}": inputs[rows, i] for i in range(inputs.shape[1])}
        columns[target] = data.targets[torch.from_numpy(rows)].numpy()
        path = directory / f"part-{part:05d}.parquet"
        pq.write_table(pa.table(columns), path, row_group_size=row_group_rows)
        written.append(path)
    return written


__all__ = ["ParquetData", "ParquetLoader", "RowGroup", "check_shardable", "deal_row_groups", "find_files",
           "write_parquet"]
