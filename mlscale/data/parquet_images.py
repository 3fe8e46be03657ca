"""Images in Parquet files: a binary image column (encoded JPEG/PNG bytes, or the ``{"bytes", "path"}`` struct
that Hugging Face ``datasets`` writes for an ``Image`` feature) and an integer label column.

``ParquetImages(source)`` reads each file's footer and its label column once (a few bytes a row: columnar
storage reads that column alone), so that item ``i`` is known to be row ``r`` of row group ``g`` with label
``y`` before any image is read. An item is then the image column of its row group, read once per process and
kept in a small cache bounded in bytes (``cache_mb``; least recently used go first), decoded and augmented as
``images.AugmentedImages`` does (the same (seed, epoch, sample) crops). A row group is the unit of reading:
``sample_shards()`` gives each item's row group, so the loaders lay the epoch out with a rank reading only its
own row groups (``sampler.shard_order``); a process holds those of the pieces it is reading, about
``24 / world`` row groups, so row groups of a few hundred images keep memory small and flat whatever the
number of files. Files may be local (a file, a folder, a glob) or in object storage (an fsspec URL: ranged
reads of the footer and of each row group's column chunk).
"""

from __future__ import annotations

import collections
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlscale.data.images import IMAGENET_MEAN, IMAGENET_STD, AugmentedImages, Listing
from mlscale.data.parquet import _pyarrow
from mlscale.data.shards import shard_paths
from mlscale.data.storage import is_remote, with_retries
from mlscale.errors import UsageError

OPEN_FILES = 16  # Parquet files a process keeps open


def _open(path: str) -> Any:
    """A Parquet file (pyarrow) of a local path or an fsspec URL; one that cannot be read is one line."""
    pq = _pyarrow()
    try:
        if is_remote(path):
            import fsspec

            return with_retries(f"opening {path}", lambda: pq.ParquetFile(fsspec.open(path, "rb").open()))
        return pq.ParquetFile(path)
    except UsageError:
        raise
    except Exception as exc:  # pyarrow's ArrowInvalid and OSError both mean: cannot be read as Parquet
        raise UsageError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None


class ParquetImages(AugmentedImages):
    """The images of Parquet files as ``(image, label)`` items (``AugmentedImages``); ``image`` and ``label``
    name the columns, ``indices`` keeps a subset (a held-out split)."""

    def __init__(self, source: str | Path | Sequence[str], size: int = 64, *, image: str = "image",
                 label: str = "label", train: bool = True, seed: int = 0, indices: Sequence[int] | None = None,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None, normalize: bool = False,
                 cache_mb: int = 256) -> None:
        super().__init__(size, train, seed, mean, std, transform, normalize)
        self.files = shard_paths(source, suffix=".parquet")
        if not self.files:
            raise UsageError(f"bad value shards={str(source)!r}: no .parquet files there")
        self.image_column, self.label_column = image, label
        groups, rows, labels = [], [], []
        for number, path in enumerate(self.files):
            file = _open(path)
            names = list(file.schema_arrow.names)
            for column in (image, label):
                if column not in names:
                    which = "image_column" if column == image else "label_column"
                    raise UsageError(f"bad value {which}={column!r}: {path} has no such column (columns: "
                                     f"{', '.join(names)})")
            for group in range(file.metadata.num_row_groups):
                count = file.metadata.row_group(group).num_rows
                groups.append((number, group, count))
                rows.append(np.arange(count, dtype=np.int32))
            labels.append(self._labels(file, path))
        self.groups = groups  # (file number, row group in it, rows)
        self.group = np.repeat(np.arange(len(groups), dtype=np.int32), [count for *_, count in groups])
        self.row = np.concatenate(rows) if rows else np.zeros(0, np.int32)
        self.label = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        if not len(self.label):
            raise UsageError(f"bad value shards={str(source)!r}: the Parquet files hold no rows")
        self.indices = np.asarray(indices if indices is not None else range(len(self.label)), np.int64)
        self.cache_bytes = cache_mb * 2**20
        self._files: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._images: collections.OrderedDict[int, tuple[list[Any], int]] = collections.OrderedDict()
        self._held, self._pid = 0, os.getpid()

    def _labels(self, file: Any, path: str) -> np.ndarray:
        column = file.read(columns=[self.label_column]).column(0)
        if column.null_count:
            raise UsageError(f"{path}: {column.null_count} row(s) have no {self.label_column}")
        try:
            return np.asarray(column.to_numpy(), dtype=np.int64)
        except (TypeError, ValueError):
            raise UsageError(f"bad value label_column={self.label_column!r}: {path}'s column holds "
                             f"{column.type}, not class indices") from None

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": collections.OrderedDict(), "_images": collections.OrderedDict(),
                "_held": 0}  # open files and read row groups stay with their process

    def name_of(self, index: int) -> str:
        item = int(self.indices[index])
        number, group, _ = self.groups[int(self.group[item])]
        return f"{os.path.basename(self.files[number])}: row group {group}, row {int(self.row[item])}"

    def label_of(self, index: int) -> int:
        return int(self.label[int(self.indices[index])])

    def sample_shards(self) -> np.ndarray:
        """The row group each item is read from: the loaders keep a rank on its own row groups."""
        return self.group[self.indices]

    def file(self, index: int) -> io.BytesIO:
        item = int(self.indices[index])
        value = self._row_group(int(self.group[item]))[int(self.row[item])]
        if isinstance(value, dict):
            value = value.get("bytes")
        if not isinstance(value, (bytes, bytearray)) or not value:
            raise ValueError(f"the {self.image_column} column holds no image bytes there")
        return io.BytesIO(value)

    def _row_group(self, group: int) -> list[Any]:
        """Row group ``group``'s image column, as Python values, read once and kept while the cache holds it."""
        if self._pid != os.getpid():  # a forked worker: its own files and cache
            self._files, self._images, self._held, self._pid = collections.OrderedDict(), collections.OrderedDict(), \
                0, os.getpid()
        kept = self._images.get(group)
        if kept is not None:
            self._images.move_to_end(group)
            return kept[0]
        number, inside, _ = self.groups[group]
        file = self._file(number)
        table = with_retries(f"reading row group {inside} of {self.files[number]}",
                             lambda: file.read_row_group(inside, columns=[self.image_column]))
        values = table.column(0).to_pylist()
        size = int(table.nbytes)
        while self._images and self._held + size > self.cache_bytes:
            self._held -= self._images.popitem(last=False)[1][1]
        self._images[group] = (values, size)
        self._held += size
        return values

    def _file(self, number: int) -> Any:
        file = self._files.get(number)
        if file is None:
            if len(self._files) >= OPEN_FILES:
                self._files.popitem(last=False)
            file = self._files[number] = _open(self.files[number])
        else:
            self._files.move_to_end(number)
        return file


def write_parquet_images(folder: str | Path, out: str | Path, per_file: int = 200, per_group: int = 50) -> list[Path]:
    """An image folder (``root/CLASS/IMAGE``) written as Parquet files of ``per_file`` rows in row groups of
    ``per_group``: an ``image`` column of the files' bytes and a ``label`` column. For tests and benchmarks."""
    import pyarrow as pa

    pq = _pyarrow()
    listing = Listing.of(Path(folder))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for start in range(0, len(listing.files), per_file):
        chosen = range(start, min(start + per_file, len(listing.files)))
        table = pa.table({"image": pa.array([(Path(folder) / listing.files[i]).read_bytes() for i in chosen],
                                            pa.binary()),
                          "label": pa.array([listing.labels[i] for i in chosen], pa.int64())})
        path = out / f"part-{start // per_file:05d}.parquet"
        pq.write_table(table, path, row_group_size=per_group)
        written.append(path)
    return written


__all__ = ["ParquetImages", "write_parquet_images"]
