"""Measuring recovery: how long a failure cost and how many steps were redone.

Every rank writes a heartbeat after each step (one small ``pwrite`` into its own file per attempt:
completed step and wall time). After a restart, rank 0 reads the previous attempt's heartbeats and the
fault log, so it knows the last step reached before the failure and when the failure happened; when
the first resumed step completes it appends an event to ``recovery.jsonl``. ``report.json`` sums them.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

_RECORD = struct.Struct("<qd")  # completed steps, unix time


class Heartbeat:
    def __init__(self, directory: Path, attempt: int, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"attempt{attempt}-rank{rank}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def beat(self, step: int) -> None:
        os.pwrite(self._fd, _RECORD.pack(step, time.time()), 0)

    def close(self) -> None:
        os.close(self._fd)


def last_beats(directory: Path, attempt: int) -> list[tuple[int, float]]:
    beats = []
    for path in sorted(directory.glob(f"attempt{attempt}-rank*")):
        data = path.read_bytes()
        if len(data) >= _RECORD.size:
            beats.append(_RECORD.unpack(data[: _RECORD.size]))
    return beats


def fault_times(log_path: Path) -> list[float]:
    if not log_path.exists():
        return []
    return [json.loads(line)["time"] for line in log_path.read_text().splitlines() if line.strip()]


class RecoveryTracker:
    """Rank 0's view of one restart: built before the first resumed step, closed after it."""

    def __init__(self, run_path: Path, heartbeat_dir: Path, fault_log: Path, attempt: int, resumed_from: int):
        beats = last_beats(heartbeat_dir, attempt - 1)
        self.failed_at_step = max((step for step, _ in beats), default=resumed_from)
        previous = [t for _, t in beats] + fault_times(fault_log)
        self.failure_time = max(previous, default=None)
        self.attempt, self.resumed_from, self.path = attempt, resumed_from, run_path / "recovery.jsonl"

    def first_step_done(self) -> dict[str, Any]:
        event = {
            "attempt": self.attempt,
            "failed_at_step": self.failed_at_step,
            "resumed_from_step": self.resumed_from,
            "steps_redone": max(0, self.failed_at_step - self.resumed_from),
            "downtime_s": time.time() - self.failure_time if self.failure_time else None,
        }
        with self.path.open("a") as handle:
            handle.write(json.dumps(event) + "\n")
        return event


def recovery_summary(run_path: Path) -> dict[str, Any]:
    path = run_path / "recovery.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    downtimes = [e["downtime_s"] for e in events if e["downtime_s"] is not None]
    return {
        "events": events,
        "downtime_s_total": sum(downtimes),
        "steps_redone_total": sum(e["steps_redone"] for e in events),
    }
