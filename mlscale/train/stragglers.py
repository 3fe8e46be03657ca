"""Live straggler detection: ranks whose own work per step is consistently above the fastest rank's.

Own work is compute plus data wait, measured by each rank *before* it communicates. Communication
cannot tell who is slow: inside an all-reduce every rank waits for the slowest, so every rank's step
time looks like the straggler's. Each rank's median own time over its last ``window`` steps is scored
against the fastest rank's; a rank is flagged while its score is at least ``threshold`` and it is at
least ``floor_ms`` slower (so microsecond jitter on a tiny model flags nobody). A median over a window
is what makes it *consistent*: one slow step (a page fault, a checkpoint) moves no median.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mlscale.train.timing import median


@dataclass
class StragglerDetector:
    threshold: float = 1.5
    floor_ms: float = 1.0
    window: int = 10
    _recent: dict[int, deque[float]] = field(default_factory=dict)
    scores: dict[int, float] = field(default_factory=dict)  # the latest score of every rank
    flagged: list[int] = field(default_factory=list)  # flagged at the latest observation
    first_flagged: dict[int, int] = field(default_factory=dict)  # rank -> step it was first flagged at
    worst: dict[int, float] = field(default_factory=dict)  # rank -> highest score while flagged

    def observe(self, step: int, own_ms: dict[int, Iterable[float]]) -> list[int]:
        """Add each rank's own-work times of its latest steps; returns the ranks flagged now."""
        for rank, times in own_ms.items():
            self._recent.setdefault(rank, deque(maxlen=self.window)).extend(times)
        medians = {rank: median(times) for rank, times in self._recent.items() if times}
        self.flagged = []
        if len(medians) < 2:
            return self.flagged
        fastest = min(medians.values())
        for rank, ms in sorted(medians.items()):
            score = ms / fastest if fastest > 0 else 1.0
            self.scores[rank] = score
            if score >= self.threshold and ms - fastest >= self.floor_ms:
                self.flagged.append(rank)
                self.first_flagged.setdefault(rank, step)
                self.worst[rank] = max(score, self.worst.get(rank, 0.0))
        return self.flagged

    def describe_now(self) -> str:
        """For the progress line: ``stragglers: rank 1 (2.0x)``, or empty."""
        if not self.flagged:
            return ""
        return "stragglers: " + ", ".join(f"rank {r} ({self.scores[r]:.1f}x)" for r in self.flagged)

    def summary(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold, "floor_ms": self.floor_ms, "window_steps": self.window,
            "flagged": {str(r): {"first_step": s, "max_score": round(self.worst[r], 3)}
                        for r, s in sorted(self.first_flagged.items())},
        }
