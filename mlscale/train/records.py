"""What a run records, and the records its record-keeping ranks share with each other.

Each shared record is a typed value that packs itself into floats for the collective
(``Strategy.share``) and is read back from them: ``to_floats`` / ``from_floats`` are the one place
that knows the positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mlscale.train.memory import MEMORY_KEYS
from mlscale.train.strategy import StepRow
from mlscale.train.timing import StepTimes

NAN = float("nan")


@dataclass(frozen=True)
class RankWindow:
    """One rank's steps since the previous metrics line: its loss (the mean and the last; ``None`` where it
    computed none, a pipeline stage before the last), the medians of its step times, and each step's own
    work (for straggler detection)."""

    rank: int
    loss_mean: float | None
    loss_last: float | None
    times: StepTimes
    own_ms: tuple[float, ...] = ()

    @classmethod
    def of(cls, rank: int, rows: Sequence[StepRow]) -> RankWindow:
        """The window of ``rank``'s ``rows``: losses left on the device come to the host here, together."""
        seen = [row.loss for row in rows if row.loss is not None]
        loss_mean = loss_last = None
        if seen:
            losses = torch.stack([torch.as_tensor(loss, dtype=torch.float64) for loss in seen])
            loss_mean, loss_last = torch.stack([losses.mean(), losses[-1]]).tolist()
        return cls(rank, loss_mean, loss_last, StepTimes.medians([row.times for row in rows]),
                   tuple(row.times.own_ms for row in rows))

    def to_floats(self) -> list[float]:
        seen = self.loss_mean is not None
        return [float(self.rank), float(seen), self.loss_mean if seen else NAN, self.loss_last if seen else NAN,
                *self.times.to_floats(), *self.own_ms]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankWindow:
        seen, times_end = bool(values[1]), 4 + StepTimes.WIDTH
        return cls(int(values[0]), values[2] if seen else None, values[3] if seen else None,
                   StepTimes.from_floats(values[4:times_end]), tuple(values[times_end:]))


@dataclass(frozen=True)
class RankTimings:
    """One rank's median step times over the measured steps (after warm-up), for ``report.json``."""

    rank: int
    medians: StepTimes

    def to_floats(self) -> list[float]:
        return [float(self.rank), *self.medians.to_floats()]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankTimings:
        return cls(int(values[0]), StepTimes.from_floats(values[1:]))


@dataclass(frozen=True)
class RankMemory:
    """One rank's training state in MB (``MEMORY_KEYS``, those it measured) and its process's peak."""

    rank: int
    state: dict[str, float] = field(default_factory=dict)
    peak_mb: float = NAN

    def to_floats(self) -> list[float]:
        return [float(self.rank), *(self.state.get(key, NAN) for key in MEMORY_KEYS), self.peak_mb]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankMemory:
        state = {key: value for key, value in zip(MEMORY_KEYS, values[1:]) if not math.isnan(value)}
        return cls(int(values[0]), state, values[1 + len(MEMORY_KEYS)])

    def as_report(self) -> dict[str, float]:
        peak = {} if math.isnan(self.peak_mb) else {"peak_mb": self.peak_mb}
        return {"rank": self.rank, **self.state, **peak}
