"""Measuring and telling recovery: who failed and how, how long it cost, how many steps were redone.

Every rank writes a heartbeat after each step (one small ``pwrite`` into its own file per attempt:
completed step and wall time). After a restart, rank 0 reads the previous attempt's heartbeats and the
fault log, so it knows the last step reached before the failure and when the failure happened; when
the first resumed step completes it appends an event to ``recovery.jsonl``. ``report.json`` sums them.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

from mlscale.common.io import append_jsonl, read_jsonl, read_records
from mlscale.errors import first_line
from mlscale.rundir import RunDir

_RECORD = struct.Struct("<qd")  # completed steps, unix time
# Errors that a rank raises because *another* rank died or hung: never the root cause.
KNOCK_ON = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|DistNetworkError|"
                      r"DistBackendError|ProcessGroupGloo|Gloo|NCCL|timed out|Timeout|SIGTERM", re.I)
_FAULT_WORDS = {"kill": "was killed{at} (SIGKILL, injected by --fault)",
                "kill_in_step": "was killed in the middle of a step{at} (SIGKILL, injected by --fault)",
                "hang": "stopped responding{at} (a hang injected by --fault; its peers timed out waiting)",
                "kill_during_checkpoint": "was killed while writing the checkpoint{at} (injected by --fault)"}


class Heartbeat:
    def __init__(self, run_dir: RunDir, attempt: int, rank: int) -> None:
        path = run_dir.heartbeat_path(attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def beat(self, step: int) -> None:
        os.pwrite(self._fd, _RECORD.pack(step, time.time()), 0)

    def close(self) -> None:
        os.close(self._fd)


def last_beats(run_dir: RunDir, attempt: int) -> list[tuple[int, float]]:
    beats = []
    for path in run_dir.heartbeat_paths(attempt):
        data = path.read_bytes()
        if len(data) >= _RECORD.size:
            beats.append(_RECORD.unpack(data[: _RECORD.size]))
    return beats


def fault_times(log_path: Path) -> list[float]:
    return [record["time"] for record in read_records(log_path)]


def launch_id() -> str:
    """Which launch of the job this process belongs to (a resumed run is a new launch, whose attempts
    count from 0 again): the elastic agent's run id."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def record_failure(run_dir: RunDir, attempt: int, rank: int, exc: BaseException) -> None:
    """Append a worker's own error (one line of it, and the steps it had completed, from its heartbeat)
    for the restarted group to report."""
    run_dir.failures_path.parent.mkdir(parents=True, exist_ok=True)
    beat = run_dir.heartbeat_path(attempt, rank)
    data = beat.read_bytes() if beat.exists() else b""
    step = _RECORD.unpack(data[: _RECORD.size])[0] if len(data) >= _RECORD.size else None
    text = first_line(exc)[:300]
    record = {"run_id": launch_id(), "attempt": attempt, "rank": rank, "step": step, "time": time.time(),
              "error": f"{type(exc).__name__}: {text}" if text else type(exc).__name__}
    with run_dir.failures_path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def describe_failure(run_dir: RunDir, attempt: int, beats: list[tuple[int, float]]) -> str:
    """In words: which rank of ``attempt`` failed first, how, and at which step.

    In order: a fault injected in that attempt (faults fire on the first attempt only); the earliest
    error a worker recorded that is not a knock-on of another rank's failure; else the rank that
    stopped first without an error of its own (killed by a signal, or hung)."""
    this_launch = launch_id()
    if attempt == 0:  # injected faults fire on a launch's first attempt only
        faults = [r for r in read_records(run_dir.faults_path) if r.get("run_id") == this_launch]
        for fault in sorted(faults, key=lambda r: r["time"]):
            at = f" at step {fault['step']}" if fault.get("step") else ""
            how = _FAULT_WORDS.get(fault["kind"], fault["kind"] + "{at}").format(at=at)
            return f"worker rank {fault.get('rank', 0)} {how}"
    errors = sorted((r for r in read_records(run_dir.failures_path) if r.get("run_id") == this_launch
                     and r["attempt"] == attempt), key=lambda r: r["time"])
    own = [r for r in errors if not KNOCK_ON.search(r["error"])]
    if own:
        at = f" at step {own[0]['step'] + 1}" if own[0].get("step") is not None else ""
        return f"worker rank {own[0]['rank']} failed{at}: {own[0]['error']}"
    reported = {r["rank"] for r in errors}
    silent = [(step, t, rank) for rank, (step, t) in enumerate(beats) if rank not in reported]
    if silent:
        step, _, rank = min(silent)
        return f"worker rank {rank} stopped at step {step + 1} without an error (killed by a signal, or hung)"
    return "a worker failed"


class RecoveryTracker:
    """Rank 0's view of one restart: built before the first resumed step, closed after it."""

    def __init__(self, run_dir: RunDir, attempt: int, resumed_from: int):
        beats = last_beats(run_dir, attempt - 1)
        self.failed_at_step = max((step for step, _ in beats), default=resumed_from)
        previous = [t for _, t in beats] + fault_times(run_dir.faults_path)
        self.failure_time = max(previous, default=None)
        self.attempt, self.resumed_from, self.path = attempt, resumed_from, run_dir.recovery_path
        self.failure = describe_failure(run_dir, attempt - 1, beats)

    def restart_notice(self, max_restarts: int) -> str:
        return (f"mlscale: {self.failure}; restarted the worker group (restart {self.attempt} of {max_restarts}), "
                f"resuming from the checkpoint of step {self.resumed_from}")

    @staticmethod
    def resumed_notice(event: dict[str, Any]) -> str:
        downtime = f" after {event['downtime_s']:.1f} s" if event["downtime_s"] is not None else ""
        redone = event["steps_redone"]
        return (f"mlscale: resumed from step {event['resumed_from_step']}{downtime}, "
                f"{redone} step{'s' if redone != 1 else ''} redone")

    def first_step_done(self) -> dict[str, Any]:
        event = {
            "attempt": self.attempt,
            "failed_at_step": self.failed_at_step,
            "resumed_from_step": self.resumed_from,
            "steps_redone": max(0, self.failed_at_step - self.resumed_from),
            "downtime_s": time.time() - self.failure_time if self.failure_time else None,
        }
        append_jsonl(self.path, event)
        return event


def recovery_summary(run_dir: RunDir) -> dict[str, Any]:
    events = read_jsonl(run_dir.recovery_path)
    downtimes = [e["downtime_s"] for e in events if e["downtime_s"] is not None]
    return {
        "events": events,
        "downtime_s_total": sum(downtimes),
        "steps_redone_total": sum(e["steps_redone"] for e in events),
    }
