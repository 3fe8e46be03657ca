"""Pipeline parallelism with torch.distributed.pipelining: the model traced and split into P stages.

``--stages P --microbatches M --schedule gpipe|1f1b [--split-points FQN,...]``. Rank ``r`` is stage
``r % P`` of replica ``r // P``; ``--workers`` must be a multiple of P, and ``--workers / P`` replicas
train data-parallel (each stage's gradients averaged over the replicas on the ``dp`` dimension of a 2-D
device mesh, after the schedule's last backward). Each replica reads its own data shard of
``--batch-size`` samples, cut into M microbatches that flow through the stages: GPipe runs every forward
then every backward; 1F1B (PipeDream-Flush) alternates them once the pipeline is full, holding at most P
microbatches' activations instead of M. Either way a step computes the gradient of the whole batch (the
mean of the microbatches' mean losses, equal microbatches), so P stages with M microbatches train
exactly like one worker with the batch.

Every rank traces the plain model on one microbatch of example inputs (``Setup.sample_inputs``) with
``torch.export`` and keeps its own stage (``mlscale.train.stages``: where the split is, and how the
traced stages keep the unsplit model's names, buffers and ties); the split is printed at the start. The
launcher traces it once on the meta device first, so a model torch cannot export, or split points that do
not fit it, are one line and exit 2 before any worker starts. The last stage's output is rebuilt into
what the model returns before the task's loss sees it. A weight tied across stages (GPT-2's token
embedding and output head) is a copy on each stage that uses it; after the backward its gradients are
summed over those stages of the replica (a process group of theirs), so every copy takes the same
update. Checkpoints hold the unsplit model's names, so they load into any other layout and back.
"""

from __future__ import annotations

import gc
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils import _pytree as pytree

from mlscale.config import PipelineOptions, TrainConfig
from mlscale.data.batches import take, to_device
from mlscale.data.dataset import MapData
from mlscale.errors import MlscaleError, UsageError
from mlscale.train.dist import all_gather_rows, receive_state, send_state
from mlscale.train.memory import state_memory
from mlscale.train.parallelize import block_container, param_count
from mlscale.train.plan import MeshDims
from mlscale.train.stages import SplitModel, StagePlan, plan_stages, retie, split_model, stage_call
from mlscale.train.state import OneModuleState, assemble, release
from mlscale.train.strategy import Batch, Learner, Setup, StepResult, StepRow, Strategy, split_degrees
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
    # What a replica's step takes and a pipeline does not: its stages split the blocks, not tensors, and it
    # neither recomputes nor accumulates.
    plan_ignores = ("activation_checkpointing", "ac_every", "grad_accum", "tp")

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
        points = config.pipeline.split_points
        if points and len(points) != config.pipeline.stages - 1:
            raise UsageError(f"bad value split-points={','.join(points)!r}: {len(points)} name(s) for --stages "
                             f"{config.pipeline.stages}; a split point is where a stage after the first begins, so "
                             f"give {config.pipeline.stages - 1}")

    @classmethod
    def check_model(cls, config: TrainConfig, model: nn.Module, world: int,
                    task_tp_plan: dict[str, str] | None = None) -> None:
        """Plan the split and trace the (meta-device) model the way every worker will, so that what cannot
        be split is refused before any process starts."""
        from mlscale.tasks import make_task

        plan = plan_stages(model, config.pipeline.stages, config.pipeline.split_points)
        task = make_task(config.task, config.task_options)
        dtype = getattr(torch, config.compute.dtype)
        sample = task.example_inputs(config.step_batch // config.pipeline.microbatches, dtype)
        split_model(model.to(dtype), plan, to_device(sample, "meta"))  # in the job's dtype, as the workers trace it

    @classmethod
    def planned_meshes(cls, workers: int) -> list[MeshDims]:
        return [MeshDims(dp_replicate=workers // stages, pp=stages) for stages in split_degrees(workers)]

    @classmethod
    def layout_options(cls, mesh: MeshDims) -> dict[str, Any]:
        return {"workers": mesh.size, "stages": mesh.pp}

    @classmethod
    def layout_name(cls, mesh: MeshDims) -> str:
        replicas = f" x{mesh.dp_replicate} replicas" if mesh.dp_replicate_enabled else ""
        return f"{cls.name} {mesh.pp}{replicas}"

    @classmethod
    def check_planned(cls, config: TrainConfig, model: nn.Module, world: int,
                      task_tp_plan: dict[str, str] | None = None) -> None:
        """The plan balances the repeated blocks over the stages (as ``mlscale.train.stages`` does) without
        tracing the model: it needs blocks, at least one a stage."""
        found = block_container(model)
        if found is None:
            raise UsageError("no repeated blocks (a ModuleList, ModuleDict or Sequential of same-typed modules) to "
                             "split into stages")
        blocks = sum(1 for child in found[1].children() if param_count(child))
        if blocks < config.pipeline.stages:
            raise UsageError(f"bad value stages={config.pipeline.stages}: the model has only {blocks} blocks to split")

    @property
    def simulates_compute(self) -> bool:
        return True  # per microbatch, in each stage's forward and backward

    # -- set-up ------------------------------------------------------------------------------------
    def setup(self, setup: Setup) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        config, env = self.config, self.env
        self.stages, self.microbatches = config.pipeline.stages, config.pipeline.microbatches
        self.replica, self.stage_index = divmod(env.rank, self.stages)
        self.first, self.last = self.stage_index == 0, self.stage_index == self.stages - 1
        self.build_plain = setup.build_model
        self.total_steps, self.steps_done, self.global_batch = setup.total_steps, setup.start_step, setup.global_batch
        mesh = init_device_mesh(env.device.type, (env.world_size // self.stages, self.stages),
                                mesh_dim_names=("dp", "pp"))
        self.dp_group = mesh["dp"].get_group()
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.recovery.collective_timeout_s))
        assert setup.sample_inputs is not None, "the trainer gives example inputs to trace the model on"
        self.stage_plan: StagePlan = plan_stages(setup.model, self.stages, config.pipeline.split_points)
        sample = take(setup.sample_inputs, slice(0, self.plan.step_batch // self.microbatches))
        self.traced = {key: tensor.shape[1:] for key, tensor in _named_leaves(sample)}
        self.split: SplitModel = split_model(setup.model, self.stage_plan, sample)
        if env.is_main:
            print(f"mlscale: pipeline of {self.stages} stages x {self.shards} replica(s), {self.microbatches} "
                  f"microbatches, {config.pipeline.schedule}: {self.split.describe()}", file=sys.stderr, flush=True)
        self.stage_model: nn.Module = self.split.stage_module(self.stage_index)
        self.module = self.stage_model
        self.tie_groups = self._tie_groups()
        stage = self.split.take_stage(self.stage_index, env.device, group=mesh["pp"].get_group())
        if config.compute.simulated_compute_ms:
            per_microbatch = config.compute.simulated_compute_ms / 1e3 / self.microbatches
            self.stage_model.register_forward_hook(
                lambda _m, _i, out: _simulated(out, per_microbatch / 3, 2 * per_microbatch / 3))
        self.learner: Learner = setup.make_learner(self.stage_model.parameters())
        self.collected = False
        task_loss, rebuild = setup.loss_fn, self.split.rebuild_output
        schedule = ScheduleGPipe if config.pipeline.schedule == "gpipe" else Schedule1F1B
        self.schedule = schedule(stage, n_microbatches=self.microbatches,
                                 loss_fn=lambda output, target: task_loss(rebuild(output), target))

    def _tie_groups(self) -> list[tuple[nn.Parameter, Any]]:
        """This stage's copies of weights tied across stages, each with the process group of the stages of
        this replica that hold one. Every rank creates every group (new_group is collective), in one order."""
        mine = []
        for tie in self.split.ties:
            for replica in range(self.shards):
                group = dist.new_group(ranks=[replica * self.stages + stage for stage in tie.stages])
                if replica == self.replica and self.stage_index in tie.stages:
                    mine.append((self.stage_model.get_parameter(tie.names[0]), group))
        return mine

    # -- the step ----------------------------------------------------------------------------------
    def step(self, batch: Batch | None) -> StepResult:
        assert batch is not None, "every pipeline stage is given its replica's batch"
        if not self.collected:
            # The plain model, the other stages' weights and the tracer's leftovers are held by reference
            # cycles (torch.export's wrapper module, frames kept by exceptions it caught): collected now,
            # before the first step's gradients and optimizer state, not whenever Python next collects.
            gc.collect()
            self.collected = True
        self.learner.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with self.learner.autocast():
            if self.first:
                self._check_shapes(batch.inputs)
                args, kwargs = stage_call(batch.inputs)
                self.schedule.step(*args, **kwargs)
            elif self.last:
                self.schedule.step(target=batch.targets, losses=losses)
            else:
                self.schedule.step()
        self._sync_gradients()
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

    @classmethod
    def check_data(cls, config: TrainConfig, data: Any) -> None:
        if isinstance(data, MapData):  # data in memory or Parquet has fixed shapes
            cls.check_fixed_shapes(data)

    @staticmethod
    def check_fixed_shapes(data: MapData) -> None:
        """Before any process starts: a Dataset whose batches change shape past the batch dimension (a few
        samples collated alone differ) cannot feed a pipeline (``_check_shapes``)."""
        seen: dict[str, tuple[int, list[int]]] = {}
        for index in sorted({*range(min(8, len(data))), len(data) // 2, len(data) - 1}):
            for key, tensor in _named_leaves(data.batch([index])[0]):
                first, shape = seen.setdefault(key, (index, list(tensor.shape[1:])))
                if list(tensor.shape[1:]) != shape:
                    raise UsageError(f"--strategy pipeline: input {key} changes shape from batch to batch (sample "
                                     f"{first} alone: [1, {', '.join(map(str, shape))}], sample {index}: "
                                     f"{list(tensor.shape)}); pipeline stages exchange fixed shapes: pad every batch "
                                     "to one length (the task's collate: mlscale.PadCollate(length=N))")

    def _check_shapes(self, inputs: Any) -> None:
        """Stages exchange tensors of the shapes they were traced with (their receive buffers are made
        from them): a batch whose inputs differ past the batch dimension (text padded to each batch's
        longest) is refused in one line that says how to pad."""
        for key, tensor in _named_leaves(inputs):
            traced = self.traced.get(key)
            if traced is not None and tensor.shape[1:] != traced:
                raise MlscaleError(f"--strategy pipeline: input {key} of this batch is {list(tensor.shape)}, but the "
                                   f"stages were traced on [-1, {', '.join(map(str, traced))}]; pipeline stages "
                                   "exchange fixed shapes: pad every batch to one length (the task's collate: "
                                   "mlscale.PadCollate(length=N))")

    def _sync_gradients(self) -> None:
        """A tied weight's copies get the sum of their gradients (the unsplit model accumulates both uses
        into one); then every gradient is averaged over the data-parallel replicas, in one flat buffer per
        dtype (one all-reduce, not one per parameter)."""
        for param, group in self.tie_groups:
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
        if self.shards == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.stage_model.parameters():
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.shards
            at = 0
            for grad in grads:
                grad.copy_(flat[at:at + grad.numel()].view_as(grad))
                at += grad.numel()

    # -- records -----------------------------------------------------------------------------------
    def gather_floats(self, rows: list[list[float]]) -> list[list[float]]:
        return all_gather_rows(self.env, rows)

    def memory(self) -> dict[str, float]:
        return state_memory(self.stage_model.parameters(), [self.learner.optimizer])

    def full_model(self) -> nn.Module | None:
        """Replica 0's stages send their parameters to rank 0, which assembles the plain model (a weight
        tied across stages arrives from each stage that holds it, equal, and is tied again)."""
        release(self.learner)  # called once, after the last checkpoint
        if self.replica != 0:
            return None
        own = {name: value.detach().cpu() for name, value in self.stage_model.state_dict().items()}
        if not self.env.is_main:
            send_state(own, dst=0, group=self.control)
            return None
        for stage in range(1, self.stages):
            own.update(receive_state(src=stage, group=self.control))
        return retie(assemble(self.build_plain, own), self.split.aliases)

    def report(self) -> dict[str, Any]:
        return {"pipeline": {"stages": self.stages, "microbatches": self.microbatches,
                             "schedule": self.config.pipeline.schedule, "replicas": self.shards,
                             "split": self.split.describe(), "split_points": list(self.stage_plan.starts),
                             "stage_params": self.split.stage_params,
                             "tied": [list(tie.names) for tie in self.split.ties],
                             "ideal_bubble": (self.stages - 1) / (self.microbatches + self.stages - 1)}}


def _named_leaves(tree: Any) -> list[tuple[str, torch.Tensor]]:
    flat, _ = pytree.tree_flatten_with_path(tree)
    return [(".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path) or "inputs", leaf)
            for path, leaf in flat if isinstance(leaf, torch.Tensor)]


def _simulated(output: Any, forward_s: float, backward_s: float) -> Any:
    """A stage's output with the simulated work on it (on its first tensor, when it returns several)."""
    if isinstance(output, torch.Tensor):
        return _SimulatedWork.apply(output, forward_s, backward_s)
    return (_SimulatedWork.apply(output[0], forward_s, backward_s), *output[1:])
