"""Float64 cells where a process keeps its metrics: private memory in a server of one process, a file in
the workers' shared folder in a server of several (``peers.py``), mapped for writing by its worker and
read by whichever worker is scraped. A scrape so reads every worker's counters as they are at that
moment: a request counted before its answer was sent is in every scrape that follows the answer.

A file is a header (the worker's generation, then the cells in use) and blocks appended one after the
other, never moved or removed: each block is its key's length in bytes, its size in cells, the key
(JSON, padded to whole cells), then the cells. The count of cells in use is written after the block,
so a reader sees whole blocks only. One process writes a file (its worker, on its event loop's thread);
updates are plain stores of 8-byte cells, which other processes read whole.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from array import array
from pathlib import Path

log = logging.getLogger("mlscale.serve")
HEADER = 2  # cells: the generation, then the cells in use (the header's included)
# A worker's file: sparse, so only the pages written take memory (a version's series take ~2.5 KiB; a
# worker would need thousands of versions, hot reloads over months, to fill it).
CAPACITY_BYTES = 16 * 1024 * 1024
Key = tuple[str, ...]
Block = tuple[memoryview, int]  # the cells and the index of the block's first


def private_block(size: int) -> Block:
    """``size`` zeroed cells of this process's own memory."""
    return memoryview(bytearray(8 * size)).cast("d"), 0


class Cells:
    """Blocks of cells for a process's series, by key; in ``path`` (shared with the other workers) when
    given, else private."""

    def __init__(self, path: Path | None = None, generation: int = 0, capacity_bytes: int = CAPACITY_BYTES) -> None:
        self.path, self._map, self._cells = path, None, None
        self._full_logged = False
        if path is None:
            return
        partial = path.with_suffix(f".{os.getpid()}.partial")
        with partial.open("w+b") as file:  # a reader opens the path only once it is whole: header written
            file.truncate(capacity_bytes)
            self._map = mmap.mmap(file.fileno(), capacity_bytes)
        self._cells = memoryview(self._map).cast("d")
        self._cells[0], self._cells[1] = generation, HEADER
        os.replace(partial, path)

    def block(self, key: Key, size: int) -> Block:
        """``size`` zeroed cells of the series ``key``; private ones when there is no file or it is full
        (then that series is this worker's own: other workers' scrapes and its retirement miss it)."""
        cells = self._cells
        if cells is None or self._map is None:
            return private_block(size)
        encoded = json.dumps(key).encode()
        at, words = int(cells[1]), -(-len(encoded) // 8)
        start = at + 2 + words
        if start + size > len(cells):
            if not self._full_logged:
                self._full_logged = True
                log.error("the shared metrics file %s is full: new series are this worker's own", self.path)
            return private_block(size)
        cells[at], cells[at + 1] = len(encoded), size
        self._map[(at + 2) * 8:(at + 2) * 8 + len(encoded)] = encoded
        cells[1] = start + size  # last: the block is whole before a reader may see it
        return cells, start

    def close(self) -> None:
        if self._cells is not None and self._map is not None:
            self._cells.release()
            self._map.close()
            self._cells = None


def read_cells(path: Path) -> tuple[int, dict[Key, list[float]]] | None:
    """(generation, each key's cells) of the file at ``path`` as they are now; None when it is gone.
    Read with plain reads: the file's pages are the ones its writer maps."""
    try:
        with path.open("rb") as file:
            header = array("d", file.read(HEADER * 8))
            if len(header) < HEADER:
                return None
            used = array("d", file.read((int(header[1]) - HEADER) * 8))
    except FileNotFoundError:
        return None
    raw, found, at = used.tobytes(), {}, 0
    while at + 2 <= len(used):
        length, size = int(used[at]), int(used[at + 1])
        words = -(-length // 8)
        key = tuple(json.loads(raw[(at + 2) * 8:(at + 2) * 8 + length]))
        start = at + 2 + words
        found[key] = used[start:start + size].tolist()
        at = start + size
    return int(header[0]), found
