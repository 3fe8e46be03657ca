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
from dataclasses import asdict
from pathlib import Path

from mlscale.common.io import atomic_write_json, read_records
from mlscale.faultspec import ANY_RANK, Fault, parse_fault
from mlscale.rundir import RunDir


class FaultInjector:
    """Applies the faults aimed at this rank; does nothing when there are none."""

    def __init__(self, specs: list[Fault] | list[str], rank: int, first_attempt: bool,
                 run_dir: RunDir | None = None, data_ranks: list[int] | None = None, seed: int = 0, fresh: bool = True,
                 hold_s: float = 0.0, started: float = 0.0) -> None:
        faults = [parse_fault(spec) for spec in specs]  # the config's are parsed already: kept as they are
        once = [f for f in faults if first_attempt and f.kind != "slow"]
        self._kill = {f.step: f for f in once if f.kind in ("kill", "hang") and f.rank == rank}
        self._kill_in_step = {f.step: f for f in once if f.kind == "kill_in_step" and f.rank == rank}
        self._checkpoint_kill = {f.step: f for f in once if f.kind == "kill_during_checkpoint"}
        self._inf = {f.step: f for f in once if f.kind == "inf_grad" and f.rank == rank}
        self._slow = [f for f in faults if f.kind == "slow" and f.rank in (rank, ANY_RANK)]
        self._data_ranks = data_ranks if data_ranks is not None else [rank]
        self.rank, self.run_dir, self.seed = rank, run_dir, seed  # run_dir: where a fault is written as it fires
        # rejoin_by: kills fire in a fresh run only; a replacement (not the first attempt) of a rank killed
        # so says when it is up, the others wait for that. ``started``: this launch's start (unix seconds),
        # before which a fired kill is an earlier launch's.
        rejoins = [f for f in faults if f.rejoin_by] if fresh and run_dir is not None else []
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
        if self.run_dir is None:
            return
        self.run_dir.faults_path.parent.mkdir(parents=True, exist_ok=True)
        with self.run_dir.faults_path.open("a") as handle:
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
        if self._announces and self.run_dir is not None:
            atomic_write_json(self.run_dir.rejoined_path(self.rank), {"time": time.time()})

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
        assert self.run_dir is not None
        fired = [record["time"] for record in read_records(self.run_dir.faults_path)
                 if (record.get("kind"), record.get("rank"), record.get("step")) == (fault.kind, fault.rank, fault.step)
                 and record.get("time", 0) >= self.started]
        if not fired:
            return False
        try:
            up = json.loads(self.run_dir.rejoined_path(fault.rank).read_text())["time"]
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
