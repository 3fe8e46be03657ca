"""Injected failures (``--fault SPEC``) for tests and demos.

- ``kill:rank=R:step=K``: worker R kills itself with SIGKILL when it reaches step K (before the step
  begins, so under per-step fault tolerance before its quorum).
- ``kill_in_step:rank=R:step=K``: the same, in the middle of step K (after its quorum and batch, before
  its gradients are averaged): a failure in flight, which per-step fault tolerance discards and redoes.
- ``:rejoin_by=J`` on either kill (per-step fault tolerance): the other replica groups do not begin
  step J (at most ``--collective-timeout``) before R's replacement has started and its Manager heartbeats
  to the lighthouse, so that it rejoins by step J however long it took to start (a slow host): what a
  test or demo of live recovery waits on, instead of on the host being fast. Time held is no step's.
- ``hang:rank=R:step=K``: worker R stops responding at step K (sleeps forever).
- ``slow:rank=R:delay_ms=D``: worker R is D milliseconds slower on every step (a straggler).
  ``slow:rank=R:delay_ms=D:p=P`` is slow on a random fraction P of its steps only (a transient
  straggler); ``rank=any`` makes one random data rank slow each step. The draws depend on the seed
  and the step alone, so every rank agrees which rank is slow at which step.
- ``kill_during_checkpoint:step=K``: the checkpoint writer dies halfway through writing the
  checkpoint of step K (its part is left torn, the checkpoint never renamed into place).
- ``inf_grad:rank=R:step=K``: worker R's loss at step K is multiplied by inf, so its gradients (and,
  through the all-reduce, everyone's) are inf: under ``--precision fp16`` the loss scaler skips the
  step and halves its scale; without a scaler the weights become NaN. For strategies whose backward
  goes through the trainer's update rule (ddp, fsdp, tp).

Kill, hang and checkpoint faults fire on the first attempt of a fresh run only, so a restarted or
resumed run can get past them. Each fault that fires is first written to ``logs/faults.jsonl`` with
its exact time, which is how recovery time is measured.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mlscale.errors import UsageError
from mlscale.io import atomic_write_json, read_records

_OPTIONAL = {"p", "rejoin_by"}
ANY_RANK = -1  # rank=any
_FIELDS = {
    "kill": ("rank", "step", "rejoin_by"),
    "kill_in_step": ("rank", "step", "rejoin_by"),
    "hang": ("rank", "step"),
    "slow": ("rank", "delay_ms", "p"),
    "kill_during_checkpoint": ("step",),
    "inf_grad": ("rank", "step"),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    step: int = 0
    delay_ms: float = 0.0
    p: float = 1.0  # the fraction of steps a slow fault is slow on
    rejoin_by: int = 0  # a kill: the step before which the others wait for the killed rank's replacement


def parse_fault(spec: str) -> Fault:
    kind, *parts = spec.split(":")
    if kind not in _FIELDS:
        raise UsageError(f"bad value fault={spec!r}: kind must be one of {', '.join(_FIELDS)}")
    expected = f"{kind}:" + ":".join(f"{f}=N" for f in _FIELDS[kind] if f not in _OPTIONAL)
    values: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or key not in _FIELDS[kind]:
            raise UsageError(f"bad value fault={spec!r}: expected {expected}")
        values[key] = _number(spec, key, raw, kind)
    missing = [field for field in _FIELDS[kind] if field not in values and field not in _OPTIONAL]
    if missing:
        raise UsageError(f"bad value fault={spec!r}: missing {', '.join(missing)}")
    fault = Fault(kind=kind, rank=int(values.get("rank", 0)), step=int(values.get("step", 0)),
                  delay_ms=values.get("delay_ms", 0.0), p=values.get("p", 1.0),
                  rejoin_by=int(values.get("rejoin_by", 0)))
    if "rejoin_by" in values and fault.rejoin_by <= fault.step:
        raise UsageError(f"bad value fault={spec!r}: rejoin_by must come after the step of the kill ({fault.step})")
    return fault


def _number(spec: str, key: str, raw: str, kind: str) -> float:
    if key == "rank" and raw == "any" and kind == "slow":
        return ANY_RANK
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"bad value fault={spec!r}: {key} must be a number"
                         + (" or 'any'" if key == "rank" and kind == "slow" else "")) from None
    if key == "p" and not 0 < value <= 1:
        raise UsageError(f"bad value fault={spec!r}: p must be in (0, 1]")
    if value < 0:
        raise UsageError(f"bad value fault={spec!r}: {key} must not be negative")
    return value


class FaultInjector:
    """Applies the faults aimed at this rank; does nothing when there are none."""

    def __init__(self, specs: list[str], rank: int, first_attempt: bool, log_path: Path | None = None,
                 data_ranks: list[int] | None = None, seed: int = 0, fresh: bool = True, hold_s: float = 0.0,
                 started: float = 0.0) -> None:
        faults = [parse_fault(spec) for spec in specs]
        once = [f for f in faults if first_attempt and f.kind != "slow"]
        self._kill = {f.step: f for f in once if f.kind in ("kill", "hang") and f.rank == rank}
        self._kill_in_step = {f.step: f for f in once if f.kind == "kill_in_step" and f.rank == rank}
        self._checkpoint_kill = {f.step: f for f in once if f.kind == "kill_during_checkpoint"}
        self._inf = {f.step: f for f in once if f.kind == "inf_grad" and f.rank == rank}
        self._slow = [f for f in faults if f.kind == "slow" and f.rank in (rank, ANY_RANK)]
        self._data_ranks = data_ranks if data_ranks is not None else [rank]
        self.rank, self.log_path, self.seed = rank, log_path, seed
        # rejoin_by: kills fire in a fresh run only; a replacement (not the first attempt) of a rank killed
        # so says when it is up, the others wait for that. ``started``: this launch's start (unix seconds),
        # before which a fired kill is an earlier launch's.
        rejoins = [f for f in faults if f.rejoin_by] if fresh and log_path is not None else []
        self._awaited = [f for f in rejoins if f.rank != rank]
        self._announces = not first_attempt and any(f.rank == rank for f in rejoins)
        self._settled: set[Fault] = set()
        self.hold_s, self.started = hold_s, started

    def delay_s(self, step: int) -> float:
        """How much slower this rank is at ``step``: the same answer on every rank for every step."""
        total = 0.0
        for index, fault in enumerate(self._slow):
            draw = random.Random(f"{self.seed}:{index}:{step}")
            if fault.rank == ANY_RANK and draw.choice(self._data_ranks) != self.rank:
                continue
            if fault.p < 1.0 and draw.random() >= fault.p:
                continue
            total += fault.delay_ms / 1000.0
        return total

    def _record(self, fault: Fault) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as handle:
            record = {**asdict(fault), "rank": self.rank, "time": time.time(),
                      "run_id": os.environ.get("TORCHELASTIC_RUN_ID", "")}
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def stop_if_due(self, step: int) -> None:
        """A kill or hang due at ``step``: before the step begins (before its quorum, under per-step)."""
        fault = self._kill.get(step)
        if fault is not None:
            self._record(fault)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: alive, holding its sockets, never answering
                time.sleep(3600)

    def during_step(self, step: int) -> None:
        """In step ``step``, once its batch is there: a kill in flight, or a slow fault's delay (spent
        inside the step's measured time)."""
        fault = self._kill_in_step.get(step)
        if fault is not None:
            self._record(fault)
            os.kill(os.getpid(), signal.SIGKILL)
        delay = self.delay_s(step) if self._slow else 0.0
        if delay:
            time.sleep(delay)

    def ready(self) -> None:
        """Called once this process can be seen by its peers (per-step: its Manager heartbeats to the
        lighthouse). The replacement of a rank killed with ``rejoin_by`` says so in
        ``logs/rejoined/rank<R>.json``."""
        if self._announces and self.log_path is not None:
            atomic_write_json(rejoined_path(self.log_path.parent, self.rank), {"time": time.time()})

    def hold(self, step: int) -> None:
        """Before ``step`` begins: for each rank killed with ``rejoin_by`` <= ``step``, wait until its kill
        has fired and its replacement is up (at most ``hold_s``, once per kill)."""
        for fault in self._awaited:
            if fault in self._settled or step < fault.rejoin_by:
                continue
            deadline = time.monotonic() + self.hold_s
            while not self._replaced(fault) and time.monotonic() < deadline:
                time.sleep(0.02)
            self._settled.add(fault)

    def _replaced(self, fault: Fault) -> bool:
        assert self.log_path is not None
        fired = [record["time"] for record in read_records(self.log_path)
                 if (record.get("kind"), record.get("rank"), record.get("step")) == (fault.kind, fault.rank, fault.step)
                 and record.get("time", 0) >= self.started]
        if not fired:
            return False
        try:
            up = json.loads(rejoined_path(self.log_path.parent, fault.rank).read_text())["time"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return bool(up >= max(fired))

    def poisons(self, step: int) -> bool:
        """Whether this rank's loss is to be made infinite at ``step`` (``inf_grad``), recorded once."""
        fault = self._inf.pop(step, None)
        if fault is not None:
            self._record(fault)
        return fault is not None

    def during_checkpoint_write(self, step: int, partial_file: Path) -> None:
        """Called by the checkpoint writer after the data is written, before the rename."""
        fault = self._checkpoint_kill.get(step)
        if fault is None:
            return
        self._record(fault)
        with partial_file.open("r+b") as handle:  # leave a torn file, as a crash mid-write would
            handle.truncate(max(1, partial_file.stat().st_size // 2))
        os.kill(os.getpid(), signal.SIGKILL)


def rejoined_path(logs: Path, rank: int) -> Path:
    """Where the replacement of a rank killed with ``rejoin_by`` says it is up."""
    return logs / "rejoined" / f"rank{rank}.json"



