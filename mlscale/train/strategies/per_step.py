"""Per-step fault tolerance for data parallelism, on torchft (``--fault-tolerance per-step``).

Every worker is a replica group of its own. Before each step its torchft ``Manager`` asks the
lighthouse for the step's quorum: the replica groups alive now. The gradients are averaged over the
quorum only (torchft's managed process group, reconfigured when the quorum changes), and the update
is applied only when the quorum commits the step; a step that failed (a peer died during it) is
discarded everywhere and its batch redone. A replica that dies is left out once the lighthouse stops
hearing from it; the others go on and never restart. Its replacement joins the next quorum and
receives the current weights, optimizer, schedule and step from a live peer over torchft's HTTP
transport, read back as tensors and plain containers only (``weights_only``).

Every replica keeps its own data shard and takes the batch of the quorum's step from it, so a sample is
trained at most once: a discarded step is redone with the same batches, and the batches of a replica
that was down are skipped (counted in the report as samples not trained). Each replica writes its steps
to ``logs/replica<i>.jsonl``: what it computed, committed, sent and received, with a digest of the state
it sent or received and of its final state, so that anyone can check the replicas agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlscale.config import TrainConfig
from mlscale.errors import UsageError
from mlscale.train.strategies.ddp import DDPStrategy
from mlscale.train.strategy import Batch, Setup, StepResult
from mlscale.train.timing import median, now

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse's address
LAUNCH_ENV = "MLSCALE_LAUNCH"  # set by mlscale's local launcher: the replicas of one launch start together


def _members_mixin(base: type) -> type:
    """A torchft process group that remembers which replica groups its current configuration joins (the
    quorum: torchft reconfigures the group whenever the quorum changes)."""

    class WithMembers(base):  # type: ignore[misc, valid-type]
        members: tuple[int, ...] = ()

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int | None = None, group_rank: int | None = None,
                      group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
            self.members = tuple(sorted({r // (group_world_size or 1) for r in global_ranks or ()}))
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                              global_ranks)

    return WithMembers


def _safe_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading what a peer sends as tensors and plain containers only
    (``torch.load(weights_only=True)``): a peer's bytes never name code to run."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def state_digest(state: Any) -> str:
    """SHA-256 of a state dict's tensors (bytes, dtype, shape) and plain values, keys in sorted order."""
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(f"K{key!s}".encode())
                feed(value[key])
        elif isinstance(value, list | tuple):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            digest.update(f"V{value!r}".encode())

    feed(state)
    return digest.hexdigest()


def replica_log_path(run_dir: str | Path, replica: int) -> Path:
    return Path(run_dir) / "logs" / f"replica{replica}.jsonl"


def read_replica_logs(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every replica's log lines (``logs/replica<i>.jsonl``), by replica."""
    logs: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / "logs").glob("replica*.jsonl")):
        replica = int(path.stem.removeprefix("replica"))
        logs[replica] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return logs


def _add_to_runs(runs: list[list[Any]], step: int, members: list[int]) -> None:
    """Steps committed without every replica, as runs ``[first, last, participants]``."""
    if runs and runs[-1][1] == step - 1 and runs[-1][2] == members:
        runs[-1][1] = step
    else:
        runs.append([step, step, list(members)])


class PerStepDDPStrategy(DDPStrategy):
    """``--strategy ddp --fault-tolerance per-step``: one process per replica group (its model unwrapped),
    gradients all-reduced by torchft across the quorum after the backward pass."""

    recovers_live = True
    compresses = False
    compiles = False

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        super().check(config, world)
        if world != 1:
            raise UsageError(f"bad value fault-tolerance='per-step': with --strategy ddp each replica group is one "
                             f"process (WORLD_SIZE=1 per group, {world} here); start one torchrun per group with "
                             f"its own REPLICA_GROUP_ID (mlscale train --workers N does this on one machine)")
        try:
            import torchft  # noqa: F401
        except ImportError:
            raise UsageError("bad value fault-tolerance='per-step': needs torchft (pip install "
                             "'mlscale[ft]')") from None
        if config.min_replicas > config.workers:
            raise UsageError(f"bad value min-replicas={config.min_replicas}: more than the {config.workers} replica "
                             "group(s) of --workers; no step could ever commit")

    @classmethod
    def world_size(cls, config: TrainConfig) -> int:
        return 1  # processes per replica group; --workers counts the groups

    @classmethod
    def replicas(cls, config: TrainConfig, world: int) -> int:
        return 1  # per replica group; the trainer multiplies by the groups

    def setup(self, setup: Setup) -> None:
        super().setup(setup)
        self.manager: Any = None
        self.replicas_total = self.env.replicas
        self.history: list[list[Any]] = []  # steps committed without every replica: [first, last, participants]
        self.samples_total = setup.start_step * self.global_batch  # trained by the job (a resume: all of them)
        self.samples_reported = self.samples_total
        self.discarded = 0
        self.quorum_ms: list[float] = []
        self.step_began = now()
        self.received: int | None = None  # the step whose state this replica received from a peer
        self.sent = False
        self.log_path = replica_log_path(self.config.run_dir or ".", self.env.replica)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = self.log_path.open("a", buffering=1)
        self._write({"event": "start", "attempt": self.env.attempt, "pid": os.getpid(), "step": setup.start_step})

    # -- joining ------------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self.log_file.write(json.dumps({"time": time.time(), **record}) + "\n")

    def _lighthouse(self) -> str:
        address = self.config.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise UsageError("per-step fault tolerance needs a torchft lighthouse: give --lighthouse ADDR (or set "
                             f"${LIGHTHOUSE_ENV}); mlscale train --workers N starts one on this machine itself")
        return address

    def _wait_for_launch(self) -> None:
        """A fresh local launch: every replica's first quorum waits for all of them, so that none starts
        training alone while the others are still importing torch (a late one would only be healed)."""
        launch = os.environ.get(LAUNCH_ENV)
        if not launch or self.env.attempt > 0 or self.steps_done > 0:
            return
        ready = Path(self.config.run_dir or ".") / "logs" / "ready" / launch
        ready.mkdir(parents=True, exist_ok=True)
        (ready / f"replica{self.env.replica}").touch()
        deadline = time.monotonic() + self.config.collective_timeout_s
        while len(list(ready.iterdir())) < self.replicas_total and time.monotonic() < deadline:
            time.sleep(0.01)

    def _start_manager(self) -> None:
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        _quiet_torchft(self.log_path.with_suffix(".torchft.log"))
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        group_type = _members_mixin(ProcessGroupNCCL if self.env.device.type == "cuda" else ProcessGroupGloo)
        self.group = group_type(timeout=timeout)
        self.manager = Manager(
            pg=self.group, load_state_dict=self._load_live_state, state_dict=self._live_state,
            min_replica_size=self.config.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timeout, rank=self.env.rank, world_size=self.env.world_size,
            lighthouse_addr=self._lighthouse(), replica_id=f"replica_{self.env.replica}",
            checkpoint_transport=_safe_transport(timeout), init_sync=False, max_retries=10)
        self.manager.load_state_dict({"step": self.steps_done, "batches_committed": self.steps_done})
        self._wait_for_launch()  # heartbeating now: the lighthouse waits for every replica that is

    def _live_state(self) -> dict[str, Any]:
        """What a replacement receives: the model, the update rule and the job's bookkeeping."""
        self.sent = True
        return {"model": self.plain.state_dict(), "learner": self.learner.state_dict(),
                "job": {"history": self.history, "samples_total": self.samples_total}}

    def _load_live_state(self, state: dict[str, Any]) -> None:
        self.plain.load_state_dict(state["model"])
        self.learner.load_state_dict(state["learner"])
        self.history = [list(run) for run in state["job"]["history"]]
        self.samples_total = int(state["job"]["samples_total"])
        self.received = self.manager.current_step()

    def _own_state_digest(self) -> str:
        return state_digest({"model": self.plain.state_dict(), "learner": self.learner.state_dict()})

    # -- the step -----------------------------------------------------------------------------------
    def begin_step(self) -> int | None:
        if self.manager is None:
            self._start_manager()
        self.step_began = now()
        self.sent, self.received = False, None
        self.manager.start_quorum()  # the quorum now; a replacement receives the state here
        step = self.manager.current_step()
        self.quorum_ms.append((now() - self.step_began) * 1e3)
        if self.received is not None:
            self._write({"event": "received", "step": step, "sha256": self._own_state_digest(),
                         "participants": list(self.group.members)})
        elif self.sent:
            self._write({"event": "sent", "step": step, "sha256": self._own_state_digest(),
                         "participants": list(self.group.members)})
        self.steps_done = step
        return step

    def reduce_gradients(self) -> bool:
        start = now()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.module.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()  # the average over the quorum; errors are the manager's to tell
        offset = 0
        for param, grad in zip(self.module.parameters(), grads):
            param.grad = flat[offset: offset + grad.numel()].view_as(grad)
            offset += grad.numel()
        self.allreduce_ms = (now() - start) * 1e3
        committed = self.manager.should_commit()
        if not committed:
            self.discarded += 1
        return committed

    def step(self, batch: Batch | None) -> StepResult:
        step = self.steps_done
        result = super().step(batch)
        members = list(self.group.members)
        record = {"event": "step", "step": step, "committed": result.applied, "participants": members,
                  "ms": round((now() - self.step_began) * 1e3, 3), "quorum_ms": round(self.quorum_ms[-1], 3)}
        self._write(record)
        if not result.applied:
            return result
        if len(members) < self.replicas_total:
            _add_to_runs(self.history, step, members)
        self.samples_total += len(members) * self.config.step_batch
        samples, self.samples_reported = self.samples_total - self.samples_reported, self.samples_total
        for row in result.rows:
            row.rank = self.env.member
            row.step_ms += self.quorum_ms[-1] + self.allreduce_ms
            row.comm_ms += self.allreduce_ms
            row.comm_exposed_ms += self.quorum_ms[-1] + self.allreduce_ms
        result.samples = samples
        return result

    # -- records ------------------------------------------------------------------------------------
    @property
    def writes_records(self) -> bool:
        """The replica that leads the current quorum writes the run directory's records."""
        return self.manager is not None and self.manager.participating_rank() == 0

    @property
    def saves_checkpoints(self) -> bool:
        return self.writes_records  # every replica holds the same state: the leader writes it

    def evaluator(self) -> nn.Module | None:
        return self.plain if self.writes_records else None

    def full_model(self) -> nn.Module | None:
        return self.plain if self.writes_records else None

    def log_fields(self, step: int, since: int) -> dict[str, Any]:
        degraded = [{"steps": [max(first, since), min(last, step)], "participants": members}
                    for first, last, members in self.history if last >= since and first <= step]
        return {"participants": list(self.group.members), "replicas": self.replicas_total,
                **({"degraded_steps": degraded} if degraded else {})}

    def report(self) -> dict[str, Any]:
        not_trained = sum((last - first + 1) * (self.replicas_total - len(members)) * self.config.step_batch
                          for first, last, members in self.history)
        report = super().report()
        report["fault_tolerance"] = {
            "mode": "per-step", "engine": "torchft", "replicas": self.replicas_total,
            "min_replicas": self.config.min_replicas, "quorum_ms_p50": median(self.quorum_ms),
            "steps_discarded_here": self.discarded}
        report["recovery"] = {
            "degraded_steps": [{"steps": [first, last], "participants": members}
                               for first, last, members in self.history],
            "steps_without_every_replica": sum(last - first + 1 for first, last, _ in self.history),
            "samples_not_trained": not_trained,
            "samples_trained": self.samples_total,
            "live_recoveries": live_recoveries(self.config.run_dir or "."),
        }
        return report

    def close(self) -> None:
        self._write({"event": "final", "step": self.steps_done, "sha256": self._own_state_digest()})
        self.log_file.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def live_recoveries(run_dir: str | Path) -> list[dict[str, Any]]:
    """Each replacement that received the state from a peer: which replica, at which step, how long after
    its predecessor's last step, and whether the state matched the sender's digest."""
    logs = read_replica_logs(run_dir)
    sent = {(r["step"], r["sha256"]) for lines in logs.values() for r in lines if r.get("event") == "sent"}
    events = []
    for replica, lines in logs.items():
        last_alive = None
        for line in lines:
            if line.get("event") == "start" and line["attempt"] > 0:
                last_alive = max((r["time"] for r in lines if r["time"] < line["time"] and r["event"] == "step"),
                                 default=None)
            if line.get("event") == "received":
                events.append({"replica": replica, "step": line["step"],
                               "rejoin_s": round(line["time"] - last_alive, 3) if last_alive else None,
                               "state_matches_sender": (line["step"], line["sha256"]) in sent})
    return events


def _quiet_torchft(path: Path) -> None:
    """torchft logs every peer failure with a traceback (to stderr, through Python's last-resort handler):
    into a file of the replica's own instead, where a failure report can point."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
        logger.setLevel(logging.WARNING)
