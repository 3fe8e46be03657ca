"""``--log-sample-ids``: which data set indices each rank trained at each step, the proof that the sharding
contract holds across restarts and resumes (every sample of an epoch trained once, at any world size).

Each data rank appends ``{"step", "attempt", "ids"}`` to ``RUN_DIR/sample_ids/rankR.jsonl`` after a step is
applied. A step redone after a restart, or after a resume from a checkpoint (on another number of workers,
say), is written again with a higher attempt, and the later attempt is the one that counts: the attempt
is the number of times the job started in this run directory before, agreed by every rank (rank 0 counts
the starts it recorded in ``sample_ids/attempts.jsonl``, every rank takes the highest count, rank 0
records this start), so it grows across in-job restarts and new launches alike.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from mlscale.common.io import append_jsonl, read_jsonl
from mlscale.rundir import RunDir


def agreed_attempt(run_dir: RunDir, rank: int, world: int, device: torch.device) -> int:
    """This start's attempt number: the starts recorded before it (rank 0 reads and records them)."""
    count = len(read_jsonl(run_dir.sample_attempts_path)) if rank == 0 else 0
    if world > 1 and dist.is_initialized():
        agreed = torch.tensor([count], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        count = int(agreed.item())
    if rank == 0:
        append_jsonl(run_dir.sample_attempts_path, {"attempt": count, "world_size": world, "time": time.time()})
    return count


def trained_once(lines: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The ids each step trained, from every rank's lines: for each step, the lines of its latest attempt."""
    latest: dict[int, int] = {}
    for line in lines:
        latest[line["step"]] = max(latest.get(line["step"], -1), line["attempt"])
    counted: dict[int, list[int]] = {}
    for line in lines:
        if line["attempt"] == latest[line["step"]]:
            counted.setdefault(line["step"], []).extend(line["ids"])
    return counted


class SampleIdLog:
    """One data rank's file of trained indices."""

    def __init__(self, run_dir: RunDir, rank: int, attempt: int) -> None:
        self.path, self.attempt = run_dir.sample_ids_path(rank), attempt

    def write(self, step: int, ids: torch.Tensor | None) -> None:
        if ids is not None:
            append_jsonl(self.path, {"step": step, "attempt": self.attempt, "ids": ids.tolist()})
