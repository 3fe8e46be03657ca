"""Straggler detection: ranks whose own work per step is far above that of the others.

Own work is compute plus data wait; communication is shared (a straggler makes everyone wait in the
all-reduce), so it cannot tell who is slow. Each rank is compared with the median of the other ranks,
which also works for a world of two.
"""

from __future__ import annotations

from mlscale.train.timing import median


def flag_stragglers(per_rank: list[dict[str, float]], ratio: float = 1.5, floor_ms: float = 1.0) -> list[int]:
    if len(per_rank) < 2:
        return []
    own = {int(r["rank"]): r["compute_ms_p50"] + r["data_wait_ms_p50"] for r in per_rank}
    flagged = []
    for rank, ms in own.items():
        others = median(v for r, v in own.items() if r != rank)
        if ms > others * ratio + floor_ms:
            flagged.append(rank)
    return sorted(flagged)
