"""A parameter server: server ranks hold the parameters and apply the optimizer, workers compute.

Ranks ``0..S-1`` are servers, each holding a shard of the parameters (whole tensors, balanced by
size) and the optimizer state for it; ranks ``S..S+N-1`` are the workers, which read data, compute
gradients on a full copy of the model, push each server its shard of the gradient and pull back the
updated shard. Consistency (``--sync``):

- ``bsp``: a step applies the average of every worker's gradient (exactly what ddp computes), or of
  the first ``N - b`` with ``--backup-workers b`` (late gradients are dropped and counted);
- ``ssp``: each gradient is applied when it arrives, and no worker starts a step more than
  ``--staleness s`` steps ahead of the slowest (Stale Synchronous Parallel);
- ``async``: each gradient is applied when it arrives; nobody waits.

In ssp and async a global step is ``N`` applied gradients, each scaled by ``1/N``, so a step moves
the model as far as a synchronous one; training ends after ``N x steps`` gradients, whoever sent them,
so fast workers do more of the work instead of idling while a straggler finishes its share.

All of it runs on torch.distributed point-to-point calls in the job's own process group (gradients
and parameters: gloo on CPU, nccl on GPU) and a gloo side group for small control messages. Server 0
sequences: it receives every worker's message header (a gloo receive from any rank), decides, and
broadcasts each decision to the other servers, so every shard sees the same sequence of events and
a checkpoint taken between two steps is consistent across shards. Implementation: ``ps_messages.py``
(what travels) and ``ps_server.py`` (the server's decisions).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mlscale.config import PSOptions, TrainConfig
from mlscale.data.batches import call_model, rows
from mlscale.errors import UsageError
from mlscale.train.checkpoint import TrainState
from mlscale.train.dist import receive_state, send_state
from mlscale.train.memory import state_memory
from mlscale.train.plan import JobPlan, MeshDims
from mlscale.train.state import MODEL, load_module_state, module_state
from mlscale.train.strategies.ps_messages import (
    Header,
    Reply,
    empty_flat,
    flat,
    unflatten_into,
)
from mlscale.train.strategies.ps_server import Sequencer, ServerShard, shard_by_size
from mlscale.train.strategy import Batch, Learner, Setup, StepResult, Strategy
from mlscale.train.timing import now


class ParameterServerStrategy(Strategy):
    name = "ps"
    options = PSOptions
    unplanned = "keeps the whole model on every worker and the parameters on its servers"

    @classmethod
    def world_size(cls, config: TrainConfig) -> int:
        return config.workers + config.ps.ps_servers

    @classmethod
    def mesh(cls, config: TrainConfig, world: int) -> MeshDims:
        return MeshDims(dp_replicate=world - config.ps.ps_servers)  # the servers come on top

    @classmethod
    def data_shards(cls, config: TrainConfig, world: int) -> list[int | None]:
        return [None] * config.ps.ps_servers + list(range(world - config.ps.ps_servers))

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        if world <= config.ps.ps_servers:
            raise UsageError(f"bad value ps-servers={config.ps.ps_servers}: a world of {world} process(es) leaves no "
                             "worker (the job needs workers + ps-servers processes)")
        workers = world - config.ps.ps_servers
        if config.ps.backup_workers and config.ps.sync != "bsp":
            raise UsageError(f"bad value backup-workers={config.ps.backup_workers}: backup workers need --sync bsp "
                             f"(got {config.ps.sync})")
        if config.ps.backup_workers >= workers:
            raise UsageError(f"bad value backup-workers={config.ps.backup_workers}: must be fewer than the {workers} "
                             "worker(s)")
        if config.compute.device != "cpu" and torch.cuda.is_available() and world > torch.cuda.device_count():
            raise UsageError(f"bad value workers={workers}: with --strategy ps every process needs a GPU of its "
                             f"own, and {workers} worker(s) + {config.ps.ps_servers} server(s) exceed the "
                             f"{torch.cuda.device_count()} GPU(s) here")
        if config.compute.precision == "fp16":
            raise UsageError("bad value precision='fp16': the parameter server does not scale losses; use bf16 "
                             "or fp32")

    def __init__(self, env: Any, config: TrainConfig, plan: JobPlan) -> None:
        super().__init__(env, config, plan)
        self.servers = config.ps.ps_servers
        self.workers = env.world_size - self.servers
        self.is_server = env.rank < self.servers

    @property
    def keeps_records(self) -> bool:
        return self.is_server

    # -- set-up ------------------------------------------------------------------------------------
    def setup(self, setup: Setup) -> None:
        if any(b.is_floating_point() for b in setup.model.buffers()):
            raise UsageError("the parameter server does not synchronise buffers (BatchNorm statistics, say); "
                             "use --strategy ddp for this model")
        timeout = timedelta(seconds=self.config.recovery.collective_timeout_s)
        # Every rank creates every group, in the same order, as torch.distributed requires.
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.server_group = (dist.new_group(ranks=list(range(self.servers)), backend="gloo", timeout=timeout)
                             if self.servers > 1 else None)
        self.model = setup.model
        self.names, self.params = map(list, zip(*setup.model.named_parameters()))
        if len(self.params) < self.servers:
            raise UsageError(f"bad value ps-servers={self.servers}: the model has only {len(self.params)} parameter "
                             "tensor(s) to shard (each server holds whole tensors)")
        self.param_shards = shard_by_size([p.numel() for p in self.params], self.servers)
        self.version = setup.start_step
        if self.is_server:
            mine = [self.params[i] for i in self.param_shards[self.env.rank]]
            self.shard = ServerShard(mine, setup.make_learner(mine), self.env, self.control, self.workers)
            self.sequencer = Sequencer(self.config, self.shard, self.server_group, self.workers, setup.total_steps,
                                       setup.start_step, setup.global_batch // self.workers)
        else:
            self.learner: Learner = setup.make_learner(self.params)  # for autocast; servers apply updates
            self.loss_fn = setup.loss_fn
            self.clock, self.last_comm_ms = 0, 0.0

    # -- the step ----------------------------------------------------------------------------------
    def step(self, batch: Batch | None) -> StepResult:
        if self.is_server:
            return self.sequencer.run_step()
        assert batch is not None, "every parameter server worker reads data"
        return self._worker_step(batch)

    def _worker_step(self, batch: Batch) -> StepResult:
        with self.learner.autocast():
            loss = self.loss_fn(call_model(self.model, batch.inputs), batch.targets)  # already on the device
        self.learner.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._synchronize()  # on a GPU, compute ends when its kernels have run, not when they were queued
        pushed = now()
        compute_ms = (pushed - batch.started) * 1e3 - batch.data_ms
        header = Header(clock=self.clock, version=self.version, epoch=batch.position.epoch,
                        offset=batch.position.offset, loss=loss.item(), compute_ms=compute_ms,
                        data_ms=batch.data_ms, comm_ms=self.last_comm_ms, samples=rows(batch.inputs))
        dist.send(header.encode(), dst=0, group=self.control)
        sends = [dist.isend(self._gradients(server), dst=server) for server in range(self.servers)]
        reply = Reply.receive(self.control)
        if not reply.done:
            for server in range(self.servers):
                buffer = empty_flat([self.params[i] for i in self.param_shards[server]])
                dist.recv(buffer, src=server)
                unflatten_into(buffer, [self.params[i].data for i in self.param_shards[server]])
        for send in sends:
            send.wait()
        self._synchronize()
        self.last_comm_ms = (now() - pushed) * 1e3
        self.clock += 1
        self.version = reply.version
        return StepResult(step=reply.version, done=reply.done)

    def _synchronize(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def _gradients(self, server: int) -> torch.Tensor:
        params = [self.params[i] for i in self.param_shards[server]]
        return flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])

    # -- records: the servers among themselves ------------------------------------------------------
    def lr(self) -> float:
        return self.shard.learner.scheduler.get_last_lr()[0]

    def gather_floats(self, rows: list[list[float]]) -> list[list[float]]:
        return rows  # server 0 sees every worker's header; the other servers keep no rows

    def _gather_shards(self, payload: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Each server's ``payload`` on server 0 (in server order), ``None`` on the others."""
        if self.env.rank != 0:
            send_state(payload, dst=0, group=self.control)
            return None
        return [payload] + [receive_state(src=server, group=self.control) for server in range(1, self.servers)]

    @classmethod
    def checkpoint_ranks(cls, config: TrainConfig, world: int) -> list[int]:
        return list(range(config.ps.ps_servers))  # each server writes its shard; workers hold no state of their own

    def _own_names(self) -> set[str]:
        return {self.names[i] for i in self.param_shards[self.env.rank]}

    def train_state(self) -> TrainState:
        state = module_state(self.model, self.shard.learner, only=self._own_names())
        if self.env.rank == 0:
            state.meta["parameter_server"] = self.sequencer.counters()
        return state

    def state_template(self) -> TrainState:
        if self.is_server:
            return module_state(self.model, self.shard.learner, for_load=True, only=self._own_names())
        # A worker reads the whole model (it starts its next step from these weights), straight into it.
        return TrainState({MODEL + name: p.data for name, p in zip(self.names, self.params)})

    def load_train_state(self, state: TrainState) -> None:
        if not self.is_server:
            return  # loaded in place
        load_module_state(self.model, self.shard.learner, state, strict=False)
        if "parameter_server" in state.meta:
            self.sequencer.restore_counters(state.meta["parameter_server"])

    def _fill_model(self, gathered: list[dict[str, Any]]) -> None:
        for indices, part in zip(self.param_shards, gathered):
            for i, value in zip(indices, part["params"]):
                self.params[i].data.copy_(value)

    def full_model(self) -> nn.Module | None:
        gathered = self._gather_shards({"params": [p.detach().cpu() for p in self.shard.params]})
        if gathered is None:
            return None
        self._fill_model(gathered)
        return self.model

    def memory(self) -> dict[str, float]:
        return state_memory(self.shard.params, [self.shard.learner.optimizer]) if self.is_server else {}

    def close(self) -> None:
        if self.is_server:
            self.shard.close()  # the last replies and parameters have reached their workers

    def report(self) -> dict[str, Any]:
        sizes = [sum(self.params[i].numel() for i in shard) for shard in self.param_shards]
        return {"parameter_server": {**self.sequencer.summary(), "shard_numel": sizes}}
