"""Per-step fault tolerance for data parallelism, on torchft (``--fault-tolerance per-step``).

Every worker is a replica group of its own. Before each step its torchft ``Manager`` asks the
lighthouse for the step's quorum: the replica groups alive now. The gradients are averaged over the
quorum only (torchft's managed process group, reconfigured when the quorum changes), and the update
is applied only when the quorum commits the step; a step that failed (a peer died during it) is
discarded everywhere and its batch redone. A replica that dies is left out once the lighthouse stops
hearing from it; the others go on and never restart. Its replacement joins the next quorum and
receives the current weights, optimizer, schedule and step from a live peer over torchft's HTTP
transport, read back as tensors and plain containers only (``weights_only``). The transport answers
only a request that carries the job's secret (``$MLSCALE_JOB_TOKEN``: 401 without it, and nothing about
the state); with ``$MLSCALE_BIND_HOST`` set (mlscale's local launcher: loopback) the transport and the
Manager listen there only.

Every replica keeps its own data shard and takes the batch of the quorum's step from it, so a sample is
trained at most once: a discarded step is redone with the same batches, and the batches of a replica
that was down are skipped (counted in the report as samples not trained). Each replica writes its steps
to ``logs/replica<i>.jsonl``: what it computed, committed, sent and received, with a digest of the state
it sent or received and of its final state, so that anyone can check the replicas agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed._serialization import _streaming_load
from torch.distributed.tensor import DTensor

from mlscale.common.io import atomic_write_json, read_jsonl, repair_jsonl
from mlscale.config import TorchftOptions, TrainConfig
from mlscale.data import Position
from mlscale.errors import UsageError
from mlscale.rundir import RunDir
from mlscale.train.dist import JOB_START_ENV, bind_host, under_launcher
from mlscale.train.strategies.ddp import DDPStrategy
from mlscale.train.strategies.sharded import FSDPStrategy
from mlscale.train.strategy import Batch, JobFinished, Setup, StepResult, StepStart
from mlscale.train.timing import median, now

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse's address
LAUNCH_ENV = "MLSCALE_LAUNCH"  # set by mlscale's local launcher: the replicas of one launch start together
TOKEN_ENV = "MLSCALE_JOB_TOKEN"  # the job's secret: every state transfer carries it


def import_torchft() -> Any:
    """torchft, its Rust servers' logging at errors only unless ``$RUST_LOG`` says otherwise (read once,
    when the module loads: every quorum is an info line)."""
    os.environ.setdefault("RUST_LOG", "error")
    import torchft

    return torchft


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


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _safe_transport(timeout: timedelta, token: str, host: str | None) -> Any:
    """torchft's HTTP checkpoint transport, made private: it answers only requests that carry ``token``
    (``Authorization: Bearer``; else 401, saying nothing of the state or its step), its fetches send it,
    and it reads what a peer sends as tensors and plain containers only (``torch.load(weights_only=True)``):
    a peer's bytes never name code to run. ``host``: the one address it listens on and gives its peers
    (None: every interface, named by host name, as torchft does)."""
    from torchft.checkpointing import http_transport
    from torchft.http import _IPv6HTTPServer

    expected = f"Bearer {token}".encode()
    family = socket.AF_INET6 if host is None or ":" in host else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        request_queue_size = _IPv6HTTPServer.request_queue_size

    def server(address: Any, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
        class Authenticated(handler):  # type: ignore[misc, valid-type]  # torchft's, behind the token
            def do_GET(self) -> None:
                given = self.headers.get("Authorization", "").encode()
                if hmac.compare_digest(given, expected):
                    super().do_GET()
                    return
                body = b"401 Unauthorized: this job's token is required\n"
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="mlscale"')
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a line on stderr per request: a peer's, or anyone's knocking

        return Server((host or address[0], address[1]), Authenticated)

    class PrivateHTTPTransport(http_transport.HTTPTransport):
        def __init__(self) -> None:
            # torchft builds its server inside __init__, from the module's name for the class
            http_transport._IPv6HTTPServer = server  # type: ignore[misc, assignment]
            try:
                super().__init__(timeout=timeout, num_chunks=0)
            finally:
                http_transport._IPv6HTTPServer = _IPv6HTTPServer  # type: ignore[misc]

        def address(self) -> str:
            if host is None:
                return super().address()
            return f"http://{_url_host(host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

        def _load_from_address(self, address: str, timeout: timedelta) -> object:  # type: ignore[override]
            request = urllib.request.Request(address, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return PrivateHTTPTransport()


@contextlib.contextmanager
def _manager_server_on(host: str | None) -> Iterator[None]:
    """torchft's Manager starts its server on every interface (``[::]``); with ``host``, there only."""
    if host is None:
        yield
        return
    import torchft.manager as module

    original = module.ManagerServer

    def bound(*, bind: str, **kwargs: Any) -> Any:
        return original(bind=f"{_url_host(host)}:{bind.rsplit(':', 1)[1]}", **kwargs)

    module.ManagerServer = bound  # type: ignore[misc]  # read by Manager.__init__
    try:
        yield
    finally:
        module.ManagerServer = original  # type: ignore[misc]


def state_digest(state: Any) -> str:
    """SHA-256 of a state dict's tensors (bytes, dtype, shape) and plain values, keys in sorted order."""
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
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


def read_replica_logs(run_dir: str | Path | RunDir) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Every replica log's lines, by (replica group, rank in it)."""
    # one writer each: a torn last line is skipped
    return {key: read_jsonl(path) for key, path in RunDir(run_dir).replica_logs().items()}


def _local(value: Any, copy: bool = False) -> Any:
    """A state dict with every DTensor replaced by this rank's shard (plain tensors travel everywhere);
    ``copy``: every tensor a copy (else views of the live ones)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.clone() if copy else value
    if isinstance(value, dict):
        return {key: _local(item, copy) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(item, copy) for item in value)
    return value


def _as_parameters(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A received optimizer state (plain tensors) shaped as this rank's parameters: a sharded parameter's
    per-parameter tensors (momentum, moments) become DTensors with its mesh and placements again."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, entry in state["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
    return state


def _add_to_runs(runs: list[list[Any]], step: int, members: list[int]) -> None:
    """Steps committed without every replica, as runs ``[first, last, participants]``."""
    if runs and runs[-1][1] == step - 1 and runs[-1][2] == members:
        runs[-1][1] = step
    else:
        runs.append([step, step, list(members)])


class PerStep:
    """Per-step fault tolerance around a strategy whose ranks each run the whole step (``ReplicaStrategy``):
    mixed in before it. Each replica group is ``world_size`` processes (the strategy's own world); torchft
    joins rank r of every group for the cross-group gradient average and for live recovery."""

    recovers_live = True
    options = TorchftOptions  # lighthouse, min replicas, group size, heartbeat timeout

    @classmethod
    def world_size(cls, config: TrainConfig) -> int:
        return config.torchft.group_size  # processes per replica group; --workers counts the groups

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        super().check(config, world)  # type: ignore[misc]
        if world != config.torchft.group_size:
            raise UsageError(f"bad value group-size={config.torchft.group_size}: per-step fault tolerance runs replica "
                             f"groups of --group-size processes, but this group has {world} (WORLD_SIZE); start "
                             "one torchrun per group with its own REPLICA_GROUP_ID (mlscale train --workers N does "
                             "this on one machine)")
        try:
            import_torchft()
        except ImportError:
            raise UsageError("bad value fault-tolerance='per-step': needs torchft (pip install "
                             "'mlscale[ft]')") from None
        if config.torchft.min_replicas > config.workers:
            raise UsageError(f"bad value min-replicas={config.torchft.min_replicas}: more than the "
                             f"{config.workers} replica group(s) of --workers; no step could ever commit")
        if under_launcher() and not (config.torchft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)):
            raise UsageError("bad value lighthouse=None: under your own torchrun, per-step fault tolerance needs the "
                             "torchft lighthouse's address (--lighthouse http://HOST:29510; run torchft_lighthouse "
                             "there)")
        if under_launcher() and not os.environ.get(TOKEN_ENV):
            raise UsageError(f"bad value {TOKEN_ENV}=None: under your own torchrun, per-step fault tolerance needs the "
                             "job's secret, the same on every host (e.g. python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))'): a replacement's state transfer must carry it")

    def setup(self, setup: Setup) -> None:
        super().setup(setup)  # type: ignore[misc]
        self.manager: Any = None
        self.replicas_total = self.env.replicas
        self.shards_per_group = self.plan.shards_per_group
        self.history: list[list[Any]] = []  # steps committed without every replica: [first, last, participants]
        self.job: dict[str, Any] = {}  # the trainer's place now (data position, samples), sent with the state
        self.discarded = 0
        self.allreduces, self.bytes_sent = 0, 0  # torchft's all-reduces across groups, and what this rank sent
        self.quorum_ms: list[float] = []
        self.step_began = now()
        self.received: dict[str, Any] | None = None  # the job's place that came with a peer's state
        self.sent = False
        self.run_dir = RunDir(self.config.run_dir or ".")
        self.log_path = self.run_dir.replica_log(self.env.replica, self.env.rank)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        repair_jsonl(self.log_path)  # a line its killed predecessor tore: cut off before this one appends
        self.log_file = self.log_path.open("a", buffering=1)
        self.ready = setup.ready
        self._write({"event": "start", "attempt": self.env.attempt, "pid": os.getpid(), "step": setup.start_step})

    # -- joining ------------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self.log_file.write(json.dumps({"time": time.time(), **record}) + "\n")

    def _wait_for_launch(self) -> None:
        """A launch (mlscale's own, or a fresh run under any launcher): every replica's first quorum waits
        for all of them, so that none starts training alone while the others are still importing torch (a
        late one would only be healed)."""
        launch = os.environ.get(LAUNCH_ENV) or ("fresh" if self.steps_done == 0 else None)
        if not launch or self.env.attempt > 0:  # a replacement joins whoever is there
            return
        ready = self.run_dir.ready_dir(launch)
        ready.mkdir(parents=True, exist_ok=True)
        self.run_dir.ready_path(launch, self.env.member).touch()
        wait_s = self.config.recovery.collective_timeout_s
        deadline, since = time.monotonic() + wait_s, time.time() - wait_s  # older files: an earlier start's
        everyone = self.replicas_total * self.env.world_size
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if sum(path.stat().st_mtime >= since for path in ready.iterdir()) >= everyone:
                    return
            time.sleep(0.01)

    def _start_manager(self) -> None:
        Manager = import_torchft().Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        _quiet_torchft(self.run_dir.torchft_log(self.env.replica, self.env.rank))
        timeout = timedelta(seconds=self.config.recovery.collective_timeout_s)
        group_type = _members_mixin(ProcessGroupNCCL if self.env.device.type == "cuda" else ProcessGroupGloo)
        self.group = group_type(timeout=timeout)
        host = bind_host()
        transport = _safe_transport(timeout, os.environ[TOKEN_ENV], host)  # the token: checked before the start
        with _manager_server_on(host):
            self.manager = Manager(
                pg=self.group, load_state_dict=self._load_live_state, state_dict=self._live_state,
                min_replica_size=self.config.torchft.min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timeout, rank=self.env.rank, world_size=self.env.world_size,
                lighthouse_addr=self.config.torchft.lighthouse or os.environ[LIGHTHOUSE_ENV],  # checked
                replica_id=f"replica_{self.env.replica}", hostname=host or socket.gethostname(),
                checkpoint_transport=transport, init_sync=False, max_retries=10)
        self.manager.load_state_dict({"step": self.steps_done, "batches_committed": self.steps_done})
        self._write({"event": "up", "transport": transport.address()})  # where a replacement fetches from
        self.ready()
        self._wait_for_launch()  # heartbeating now: the lighthouse waits for every replica that is

    def _own_state(self) -> dict[str, Any]:
        """This rank's model and update rule as plain tensors: its shards under fsdp (rank r of a group
        sends to rank r of the replacement, which holds the same shards)."""
        return {"model": _local(self.module.state_dict()), "learner": _local(self.learner.state_dict())}

    def _live_state(self) -> dict[str, Any]:
        """What a replacement receives: the model, the update rule and the job's bookkeeping. Copies: on
        the CPU torchft serves the tensors it is given while this rank trains on (a forward may update
        buffers in place before the replacement has read them)."""
        self.sent = True
        return {**_local(self._own_state(), copy=True), "job": {"history": self.history, **self.job}}

    def _load_live_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, tensor in _local(self.module.state_dict()).items():
                tensor.copy_(state["model"][name])  # in place: a shard's local tensor is the parameter's
        learner = state["learner"]
        learner["optimizer"] = _as_parameters(self.learner.optimizer, learner["optimizer"])
        self.learner.load_state_dict(learner)
        self.history = [list(run) for run in state["job"]["history"]]
        self.received = state["job"]

    def _own_state_digest(self) -> str:
        return state_digest(self._own_state())

    # -- the step -----------------------------------------------------------------------------------
    def begin_step(self, position: Position | None, samples_seen: int) -> StepStart | None:
        if self.manager is None:
            if self.env.attempt > 0 and job_finished(self.run_dir, self.total_steps):
                raise JobFinished("the job finished while this replica group was down")
            self._start_manager()
        self.step_began = now()
        self.sent, self.received = False, None
        self.job = {"position": [position.epoch, position.offset] if position else None, "samples_seen": samples_seen}
        self.manager.start_quorum()  # the quorum now; a replacement receives the state here
        step = self.manager.current_step()
        self.quorum_ms.append((now() - self.step_began) * 1e3)
        members = list(self.group.members)
        if len(members) < self.replicas_total and job_finished(self.run_dir, self.total_steps):
            raise JobFinished("the job finished without this replica group")  # it would train on alone
        self.steps_done = step
        if self.sent:
            self._write({"event": "sent", "step": step, "sha256": self._own_state_digest(), "participants": members})
        if self.received is None:
            return None
        self._write({"event": "received", "step": step, "sha256": self._own_state_digest(), "participants": members})
        where = self.received["position"]
        return StepStart(step, Position(*where) if where else None, self.received["samples_seen"])

    def reduce_gradients(self) -> bool:
        start = now()
        params = list(self.module.parameters())
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [_local(param.grad) for param in params]  # under fsdp: this rank's reduce-scattered shard
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        self.manager.allreduce(flat).wait()  # the average over the quorum; errors are the manager's to tell
        self.allreduces, self.bytes_sent = self.allreduces + 1, self.bytes_sent + flat.numel() * flat.element_size()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
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
        shards = self.replicas_total * self.shards_per_group
        result.positions = dict.fromkeys(range(shards), batch.position if batch is not None else Position())
        for row in result.rows:  # the quorum came before the batch; the all-reduce after the backward
            row.rank = self.env.member
            times = row.times
            row.times = dataclasses.replace(
                times, step_ms=times.step_ms + self.quorum_ms[-1], comm_ms=times.comm_ms + self.allreduce_ms,
                comm_exposed_ms=times.comm_exposed_ms + self.quorum_ms[-1] + self.allreduce_ms,
                compute_ms=times.compute_ms - self.allreduce_ms)
        result.samples = len(members) * self.shards_per_group * self.plan.step_batch
        if result.done:  # before the end's gathers and releases (fsdp) change what this rank holds
            self._write({"event": "final", "step": self.steps_done, "sha256": self._own_state_digest()})
            if self.writes_records:
                atomic_write_json(self.run_dir.finished_path, {"step": self.steps_done, "time": time.time()})
        return result

    # -- records ------------------------------------------------------------------------------------
    @property
    def leads(self) -> bool:
        """Whether this rank's replica group leads the current quorum (the same answer on all its ranks)."""
        return self.manager is not None and self.manager.participating_rank() == 0

    @property
    def writes_records(self) -> bool:
        """Rank 0 of the group that leads the current quorum writes the run directory's records."""
        return self.leads and self.env.is_main

    @property
    def saves_checkpoints(self) -> bool:
        return self.leads  # every group holds the same state: the leading one's ranks write it

    def evaluator(self) -> nn.Module | None:
        return super().evaluator() if self.leads else None  # type: ignore[misc]

    def full_model(self) -> nn.Module | None:
        return super().full_model() if self.leads else None  # type: ignore[misc]

    def log_fields(self, step: int, since: int) -> dict[str, Any]:
        degraded = [{"steps": [max(first, since), min(last, step)], "participants": members}
                    for first, last, members in self.history if last >= since and first <= step]
        return {"participants": list(self.group.members), "replicas": self.replicas_total,
                **({"degraded_steps": degraded} if degraded else {})}

    def report(self) -> dict[str, Any]:
        not_trained = sum((last - first + 1) * (self.replicas_total - len(members)) * self.shards_per_group
                          * self.plan.step_batch for first, last, members in self.history)
        report = super().report()  # type: ignore[misc]
        report["communication"] = {"cross_group_allreduces": self.allreduces, "bytes_sent": self.bytes_sent,
                                   "grad_accum": self.plan.grad_accum}  # no DDP buckets here
        report["fault_tolerance"] = {
            "mode": "per-step", "engine": "torchft", "replicas": self.replicas_total,
            "group_size": self.env.world_size,
            "min_replicas": self.config.torchft.min_replicas, "quorum_ms_p50": median(self.quorum_ms),
            "steps_discarded_here": self.discarded}
        report["recovery"] = {
            "degraded_steps": [{"steps": [first, last], "participants": members}
                               for first, last, members in self.history],
            "steps_without_every_replica": sum(last - first + 1 for first, last, _ in self.history),
            "samples_not_trained": not_trained,
            "live_recoveries": live_recoveries(self.run_dir),
        }
        return report

    def close(self) -> None:
        self.log_file.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        super().close()  # type: ignore[misc]


class PerStepDDPStrategy(PerStep, DDPStrategy):
    """``--strategy ddp --fault-tolerance per-step``: a replica group is one process (its model unwrapped);
    gradients are all-reduced by torchft across the quorum after the backward pass."""

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        if config.torchft.group_size != 1:
            raise UsageError(f"bad value group-size={config.torchft.group_size}: under --strategy ddp a replica "
                             "group is one process; --strategy fsdp shards the model over a group of several (HSDP)")
        super().check(config, world)


class PerStepFSDPStrategy(PerStep, FSDPStrategy):
    """``--strategy fsdp --fault-tolerance per-step``: HSDP, fault tolerant across the replicated dimension.
    A replica group of ``--group-size`` processes shards the model with FSDP2 over its own world (the
    gradients reduce-scattered inside the group); rank r of every group then averages its gradient shard
    across the quorum through torchft, and a replacement group's rank r receives rank r's shards."""


def job_finished(run_dir: str | Path | RunDir, total_steps: int) -> bool:
    """Whether the quorum has committed the job's last step: the leader writes ``logs/finished.json``
    then (before its final checkpoint and evaluation). A replica that finds itself without its peers, or
    a replacement that starts after it, must not train on alone from where it stands."""
    try:
        return int(json.loads(RunDir(run_dir).finished_path.read_text())["step"]) >= total_steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def live_recoveries(run_dir: str | Path | RunDir) -> list[dict[str, Any]]:
    """Each replacement that received the state from a peer: which replica, at which step, how long after
    its predecessor's last step, and whether the state matched the sender's digest."""
    started = float(os.environ.get(JOB_START_ENV, 0))  # this launch's, not a resumed run's earlier ones
    logs = {key: [line for line in lines if line["time"] >= started]
            for key, lines in read_replica_logs(run_dir).items()}
    sent = {(r["step"], r["sha256"]) for lines in logs.values() for r in lines if r.get("event") == "sent"}
    events = []
    for (group, rank), lines in logs.items():
        last_alive = None
        for line in lines:
            if line.get("event") == "start" and line["attempt"] > 0:
                last_alive = max((r["time"] for r in lines if r["time"] < line["time"] and r["event"] == "step"),
                                 default=None)
            if line.get("event") == "received":
                events.append({"replica": group, "rank": rank, "step": line["step"],
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
