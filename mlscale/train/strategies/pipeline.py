"""Pipeline parallelism with torch.distributed.pipelining: the model's blocks split into P stages.

``--stages P --microbatches M --schedule gpipe|1f1b``. Rank ``r`` is stage ``r % P`` of replica
``r // P``; ``--workers`` must be a multiple of P, and ``--workers / P`` replicas train data-parallel
(each stage's gradients averaged over the replicas by DDP, on the ``dp`` dimension of a 2-D device
mesh). Each replica reads its own data shard of ``--batch-size`` samples, cut into M microbatches
that flow through the stages: GPipe runs every forward then every backward; 1F1B (PipeDream-Flush)
alternates them once the pipeline is full, holding at most P microbatches' activations instead of M.
Either way a step computes the gradient of the whole batch (the mean of the microbatches' mean losses,
equal microbatches), so P stages with M microbatches train exactly like one worker with the batch.

The split is balanced by parameter count (``mlscale.train.parallelize.plan_stages``) and printed at
the start. A stage is the plain model with the other stages' parts removed, so its parameters keep the
unsplit model's names: checkpoints from a pipeline load into any other layout and back.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from mlscale.config import PipelineOptions, TrainConfig
from mlscale.errors import UsageError
from mlscale.train.dist import all_gather_rows, receive_state, send_state
from mlscale.train.memory import state_memory
from mlscale.train.parallelize import StagePlan, keep_stage, plan_stages
from mlscale.train.plan import MeshDims
from mlscale.train.state import OneModuleState, assemble, release
from mlscale.train.strategy import Batch, Learner, Setup, StepResult, StepRow, Strategy
from mlscale.train.timing import StepTimes, now


class _SimulatedWork(torch.autograd.Function):
    """Benchmarks: a fixed time in a stage's forward and its backward (identity on the values)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class PipelineStrategy(OneModuleState, Strategy):
    name = "pipeline"
    options = PipelineOptions

    @classmethod
    def mesh(cls, config: TrainConfig, world: int) -> MeshDims:
        return MeshDims(dp_replicate=world // config.pipeline.stages, pp=config.pipeline.stages)

    @classmethod
    def data_shards(cls, config: TrainConfig, world: int) -> list[int | None]:
        return [rank // config.pipeline.stages for rank in range(world)]  # every stage of a replica: its shard

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        if config.pipeline.stages < 2:
            raise UsageError(f"bad value stages={config.pipeline.stages}: a pipeline needs at least 2 stages")
        if world % config.pipeline.stages:
            raise UsageError(f"bad value workers={world}: --strategy pipeline needs a multiple of --stages "
                             f"{config.pipeline.stages} processes (workers = stages x data-parallel replicas)")
        if config.batch_size % config.pipeline.microbatches:
            raise UsageError(f"bad value microbatches={config.pipeline.microbatches}: must divide --batch-size "
                             f"{config.batch_size} (equal microbatches keep the step equal to the whole batch's)")
        if config.pipeline.schedule == "1f1b" and config.pipeline.microbatches < config.pipeline.stages:
            raise UsageError(f"bad value microbatches={config.pipeline.microbatches}: 1f1b needs at least one "
                             f"microbatch per stage ({config.pipeline.stages}); use more or --schedule gpipe")
        if config.compute.precision == "fp16":
            raise UsageError("bad value precision='fp16': pipeline schedules do not scale losses; use bf16 or fp32")

    @classmethod
    def check_model(cls, config: TrainConfig, model: nn.Module, world: int,
                    task_tp_plan: dict[str, str] | None = None) -> None:
        plan_stages(model, config.pipeline.stages)

    @property
    def simulates_compute(self) -> bool:
        return True  # per microbatch, in each stage's forward and backward

    # -- set-up ------------------------------------------------------------------------------------
    def setup(self, setup: Setup) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        config, env = self.config, self.env
        self.stages, self.microbatches = config.pipeline.stages, config.pipeline.microbatches
        self.replica, self.stage_index = divmod(env.rank, self.stages)
        self.first, self.last = self.stage_index == 0, self.stage_index == self.stages - 1
        self.build_plain, self.loss_fn = setup.build_model, setup.loss_fn
        self.total_steps, self.steps_done, self.global_batch = setup.total_steps, setup.start_step, setup.global_batch
        mesh = init_device_mesh(env.device.type, (env.world_size // self.stages, self.stages),
                                mesh_dim_names=("dp", "pp"))
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.recovery.collective_timeout_s))
        self.plan: StagePlan = plan_stages(setup.model, self.stages)
        if env.is_main:
            print(f"mlscale: pipeline of {self.stages} stages x {self.shards} replica(s), {self.microbatches} "
                  f"microbatches, {config.pipeline.schedule}: {self.plan.describe()}", file=sys.stderr, flush=True)
        self.stage_model = keep_stage(setup.model, self.plan, self.stage_index)
        self.module: nn.Module = self.stage_model
        if self.shards > 1:
            device_ids = [env.device] if env.device.type == "cuda" else None
            self.module = DistributedDataParallel(self.stage_model, device_ids=device_ids,
                                                  process_group=mesh["dp"].get_group())
        if config.compute.simulated_compute_ms:
            per_microbatch = config.compute.simulated_compute_ms / 1e3 / self.microbatches
            self.stage_model.register_forward_hook(
                lambda _m, _i, out: _SimulatedWork.apply(out, per_microbatch / 3, 2 * per_microbatch / 3))
        self.learner: Learner = setup.make_learner(self.module.parameters())
        stage = PipelineStage(self.module, self.stage_index, self.stages, env.device, group=mesh["pp"].get_group())
        schedule = ScheduleGPipe if config.pipeline.schedule == "gpipe" else Schedule1F1B
        self.schedule = schedule(stage, n_microbatches=self.microbatches, loss_fn=self.loss_fn)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, batch: Batch | None) -> StepResult:
        assert batch is not None, "every pipeline stage is given its replica's batch"
        self.learner.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with self.learner.autocast():
            if self.first:
                self.schedule.step(batch.inputs)
            elif self.last:
                self.schedule.step(target=batch.targets, losses=losses)
            else:
                self.schedule.step()
        update_start = now()
        self.learner.apply()
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        end = now()
        step_ms, optimizer_ms = (end - batch.started) * 1e3, (end - update_start) * 1e3
        # Only the last stage sees the loss; time in the schedule includes waiting for other stages.
        loss = torch.stack(losses).mean().detach() if self.last else None
        row = StepRow(self.env.rank, loss, StepTimes(step_ms=step_ms, compute_ms=step_ms - batch.data_ms - optimizer_ms,
                                                     data_wait_ms=batch.data_ms, optimizer_ms=optimizer_ms))
        self.steps_done += 1
        return StepResult(step=self.steps_done, done=self.steps_done >= self.total_steps, samples=self.global_batch,
                          rows=[row], positions=dict.fromkeys(range(self.shards), batch.position))

    # -- records -----------------------------------------------------------------------------------
    def gather_floats(self, rows: list[list[float]]) -> list[list[float]]:
        return all_gather_rows(self.env, rows)

    def memory(self) -> dict[str, float]:
        return state_memory(self.stage_model.parameters(), [self.learner.optimizer])

    def full_model(self) -> nn.Module | None:
        """Replica 0's stages send their parameters to rank 0, which assembles the plain model."""
        release(self.learner)  # called once, after the last checkpoint
        if self.replica != 0:
            return None
        own = {name: value.detach().cpu() for name, value in self.stage_model.state_dict().items()}
        if not self.env.is_main:
            send_state(own, dst=0, group=self.control)
            return None
        for stage in range(1, self.stages):
            own.update(receive_state(src=stage, group=self.control))
        return assemble(self.build_plain, own)

    def report(self) -> dict[str, Any]:
        return {"pipeline": {"stages": self.stages, "microbatches": self.microbatches,
                             "schedule": self.config.pipeline.schedule, "replicas": self.shards,
                             "split": self.plan.describe(), "stage_params": self.plan.params,
                             "ideal_bubble": (self.stages - 1) / (self.microbatches + self.stages - 1)}}
