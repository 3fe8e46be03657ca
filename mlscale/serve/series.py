"""A metric's values in float64 cells (``cells.py``): a counter, a gauge, a histogram. Plain objects with
no lock: each series has one writer (the event loop's thread, or the generation engine's step thread
for the engine's own series), and readers take each cell whole."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.utils import floatToGoString

from mlscale.serve.cells import Block, private_block


class Counter:
    """A count in a cell of its own."""

    __slots__ = ("at", "cells")

    def __init__(self, block: Block | None = None) -> None:
        self.cells, self.at = block or private_block(1)

    @property
    def value(self) -> float:
        return self.cells[self.at]

    def inc(self, amount: float = 1.0) -> None:
        self.cells[self.at] += amount


class Gauge(Counter):
    """A value set, in a cell of its own."""

    __slots__ = ()

    def set(self, value: float) -> None:
        self.cells[self.at] = value


class Histogram:
    """Counts per bucket (the last one past every bound), then the sum, in cells of their own."""

    __slots__ = ("_sum_at", "at", "bounds", "cells")

    def __init__(self, bounds: tuple[float, ...], block: Block | None = None) -> None:
        self.bounds = bounds
        self.cells, self.at = block or private_block(len(bounds) + 2)
        self._sum_at = self.at + len(bounds) + 1

    def observe(self, value: float) -> None:
        self.cells[self.at + bisect_left(self.bounds, value)] += 1  # first bucket whose upper bound is >= value
        self.cells[self._sum_at] += value

    @property
    def counts(self) -> list[int]:
        return [int(count) for count in self.cells[self.at:self._sum_at]]

    @property
    def sum(self) -> float:
        return self.cells[self._sum_at]

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add(self, counts: list[int], total: float) -> None:
        """Another histogram's counts and sum added (a whole-server view)."""
        for index, count in enumerate(counts):
            self.cells[self.at + index] += count
        self.cells[self._sum_at] += total

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            cumulative += count
            out.append((bound, cumulative))
        return out
