"""Measured time: the one timing helper used by the trainer, strategies and benchmarks."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields


def now() -> float:
    return time.perf_counter()


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


@dataclass(frozen=True)
class StepTimes:
    """Where a step's wall time went, in ms, as the rank that ran it measured it; or each field's median
    over many steps. Communication is busy time (``comm_ms``) and the part of it after compute ended
    (``comm_exposed_ms``: what overlapping with the backward pass did not hide)."""

    step_ms: float = 0.0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    comm_exposed_ms: float = 0.0
    data_wait_ms: float = 0.0
    optimizer_ms: float = 0.0  # the update (optimizer, scaler, schedule), apart from compute

    @property
    def own_ms(self) -> float:
        """Time the rank spent on its own work (compute, update, data wait): what tells a straggler."""
        return self.compute_ms + self.optimizer_ms + self.data_wait_ms

    def as_dict(self, suffix: str = "") -> dict[str, float]:
        """``{"step_ms": ..., ...}`` in field order; ``suffix`` is added to every key (``_p50``)."""
        return {name + suffix: getattr(self, name) for name in _STEP_TIMES}

    @classmethod
    def medians(cls, times: Sequence[StepTimes]) -> StepTimes:
        """Each field's median over ``times`` (zeros for none)."""
        return cls(**{name: median(getattr(t, name) for t in times) for name in _STEP_TIMES})

    # On the wire (a record that holds one packs it so): its floats in field order.
    WIDTH = 6

    def to_floats(self) -> list[float]:
        return [getattr(self, name) for name in _STEP_TIMES]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> StepTimes:
        return cls(*values[:cls.WIDTH])


_STEP_TIMES = tuple(f.name for f in fields(StepTimes))
assert len(_STEP_TIMES) == StepTimes.WIDTH


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by possibly overlapping ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class CommTimer:
    """Records when each communication call of a step started and finished.

    Completion callbacks may run on a backend thread, hence the lock. ``busy_ms`` is the wall time
    during which at least one collective was in flight; ``exposed_ms`` the part of it after compute
    ended (what overlapping could not hide).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._last_launch = 0.0
        self.calls = 0  # collectives launched since the start (the buckets of every all-reduce)

    def launched(self) -> float:
        start = now()
        with self._lock:
            self._last_launch = start
            self.calls += 1
        return start

    def finished(self, start: float) -> None:
        end = now()
        with self._lock:
            self._intervals.append((start, end))

    def take(self, backward_end: float) -> tuple[float, float]:
        """(busy_ms, exposed_ms) since the last call, then reset.

        Exposed time is communication in flight between the launch of the step's last collective
        (gradient computation has ended) and ``backward_end``, when the trainer got control back.
        """
        with self._lock:
            intervals, self._intervals = self._intervals, []
            last_launch = self._last_launch
        exposed = [(max(start, last_launch), min(end, backward_end)) for start, end in intervals]
        return union_length(intervals) * 1e3, union_length([(s, e) for s, e in exposed if e > s]) * 1e3
