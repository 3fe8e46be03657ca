"""Strategies that split the model itself across ranks, each rank running the whole step.

- ``fsdp``: fully sharded data parallelism (ZeRO-3) with FSDP2 ``fully_shard``. Every rank holds
  1/N of the parameters, gradients and optimizer state; a block's parameters are all-gathered just
  before it runs and freed after, gradients are reduce-scattered. Each rank reads its own data shard,
  so it trains like ddp with N workers, on about 1/N of the memory for the training state.
- ``tp``: tensor parallelism (Megatron-LM) with ``torch.distributed.tensor.parallel``, from a plan of
  module-name patterns (the task's ``tp_plan``, else the model's own, else tinylm's): attention heads and
  MLP columns split over the N ranks, which compute one replica together, on the same batch: one data
  shard, trained like one worker.
- ``fsdp --tp T``: both, on a 2-D mesh: each block split over T ranks, FSDP2 sharding over the rest.

Both build the model on the meta device and materialise only what a rank holds
(``mlscale.train.materialize``); both are applied to the plain model from outside
(``mlscale.train.parallelize``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mlscale.config import TrainConfig
from mlscale.errors import UsageError
from mlscale.train.parallelize import apply_fsdp, apply_tp, check_tp_divides, tp_plan, unshardable
from mlscale.train.plan import MeshDims
from mlscale.train.strategies.replica import ReplicaStrategy
from mlscale.train.strategy import Batch, StepResult, split_degrees


class FSDPStrategy(ReplicaStrategy):
    """FSDP2 over the data-parallel ranks; with ``--tp T``, over tensor-parallel groups of T ranks (a 2-D
    mesh ``dp x tp``, tp innermost: the T ranks of a group are neighbours, on one host when they can be)."""

    name = "fsdp"
    splits_model = True
    scalars: list[nn.Parameter] | None = None  # the parameters FSDP2 leaves whole (scalars), once known
    updating_in_backward = False  # --optimizer-in-backward: the hooks are registered

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        tp = config.model.tp
        if world % tp:
            raise UsageError(f"bad value workers={world}: --strategy fsdp --tp {tp} needs a multiple of {tp} "
                             f"processes (workers = {tp} tensor-parallel ranks x data-parallel shards)")
        if tp > 1 and config.per_step:
            raise UsageError(f"bad value tp={tp}: per-step fault tolerance replicates FSDP2 groups (HSDP) through "
                             "torchft, which does not split blocks; use --fault-tolerance restart with --tp")
        if config.model.offload == "cpu" and config.compute.device == "cpu":
            raise UsageError("bad value offload='cpu': it moves a GPU's training state to host memory; this job runs "
                             "on the CPU already (--device cpu)")
        if config.optim.optimizer_in_backward:
            _check_in_backward(config)
        if tp > 1 and config.compute.precision == "fp16":
            raise UsageError("bad value precision='fp16': the loss scaler cannot unscale the mix of split (DTensor) "
                             "and replicated gradients that --tp makes; use bf16 or fp32")

    @classmethod
    def mesh(cls, config: TrainConfig, world: int) -> MeshDims:
        return MeshDims(dp_shard=world // config.model.tp, tp=config.model.tp)

    @classmethod
    def data_shards(cls, config: TrainConfig, world: int) -> list[int | None]:
        return [rank // config.model.tp for rank in range(world)]  # a tensor-parallel group reads one shard

    @classmethod
    def checks_model(cls, config: TrainConfig) -> bool:
        return config.model.tp > 1

    @classmethod
    def planned_meshes(cls, workers: int) -> list[MeshDims]:
        """Sharded over every degree; and over the rest of the job when blocks are split over T ranks."""
        degrees = split_degrees(workers)
        return [MeshDims(dp_shard=shards) for shards in degrees] + [
            MeshDims(dp_shard=workers // tp, tp=tp) for tp in degrees if tp < workers and workers // tp > 1]

    @classmethod
    def layout_options(cls, mesh: MeshDims) -> dict[str, Any]:
        return {"workers": mesh.size, **({"tp": mesh.tp} if mesh.tp_enabled else {})}

    @classmethod
    def layout_name(cls, mesh: MeshDims) -> str:
        return f"{cls.name} {mesh.dp_shard}" + (f" x tp {mesh.tp}" if mesh.tp_enabled else "")

    @classmethod
    def check_model(cls, config: TrainConfig, model: nn.Module, world: int,
                    task_tp_plan: dict[str, str] | None = None) -> None:
        if config.model.tp > 1:
            check_tp_divides(model, tp_plan(model, task_tp_plan), config.model.tp)

    def wrap(self, model: nn.Module) -> nn.Module:
        tp = self.config.model.tp
        if tp == 1:
            mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("dp",))
            self.dp_group = mesh.get_group()
            return apply_fsdp(model, mesh, offload=self.offload)
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        self.dp_group = mesh["dp"].get_group()
        self.tp_plan = self.announce(tp_plan(model, self.declared_tp_plan))
        check_tp_divides(model, self.tp_plan, tp)
        apply_tp(model, mesh["tp"], self.tp_plan)
        if not self.env.is_main:  # the same on every rank (a gathered output is a view): rank 0 says it
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return apply_fsdp(model, mesh["dp"], offload=self.offload)

    @property
    def offload(self) -> bool:
        """--offload cpu, on a GPU (on a CPU-only host with --device auto there is nothing to offload from)."""
        return self.config.model.offload == "cpu" and self.env.device.type == "cuda"

    def synchronising(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if self.env.distributed:
            self.module.set_requires_gradient_sync(sync)  # FSDP2: no reduce-scatter until the last micro-step
        return contextlib.nullcontext()

    def whole_scalars(self) -> list[nn.Parameter]:
        """The scalar parameters FSDP2 leaves whole (``unshardable``), in the same order on every rank. Found
        after set-up: materialising the meta-device model made new parameters."""
        if self.scalars is None:
            whole = unshardable(self.module) if self.env.distributed else set()
            self.scalars = [param for param in self.module.parameters() if param in whole]
        return self.scalars

    def step(self, batch: Batch | None) -> StepResult:
        if self.config.optim.optimizer_in_backward and not self.updating_in_backward:
            self.update_in_backward()
        return super().step(batch)

    def update_in_backward(self) -> None:
        """--optimizer-in-backward: a hook on every sharded parameter steps the optimizer as soon as FSDP2
        has reduce-scattered its gradient (FSDP2 calls post-accumulate-grad hooks there), then frees the
        gradient; the block's reduce-scatter buffer goes with its last gradient. Registered at the first
        step, on the parameters the optimizer holds (materialising made them). The scalars FSDP2 leaves
        whole keep the usual path: averaged after the backward pass (``reduce_gradients``), stepped by
        ``Learner.apply``, which then finds no other gradient to apply."""
        whole = set(self.whole_scalars())
        for param in self.module.parameters():
            if param not in whole and param.requires_grad:
                param.register_post_accumulate_grad_hook(self._update_one)
        self.updating_in_backward = True

    def _update_one(self, param: torch.Tensor) -> None:
        # The optimizer steps every parameter that has a gradient: at this moment only this one, once the
        # scalars' (local, not yet averaged) gradients are set aside. Elementwise rules (SGD, Adam) make
        # this the update of the whole step; the schedule still moves once a step, in Learner.apply.
        held = [(scalar, scalar.grad) for scalar in self.whole_scalars() if scalar.grad is not None]
        for scalar, _ in held:
            scalar.grad = None
        self.learner.optimizer.step()
        param.grad = None
        for scalar, grad in held:
            scalar.grad = grad

    def reduce_gradients(self) -> bool:
        """The scalar parameters FSDP2 leaves whole (``unshardable``): their gradients averaged over the data
        shards here, as FSDP2 averages the others."""
        grads = [param.grad for param in self.whole_scalars() if param.grad is not None]
        if grads:
            flat = torch.stack(grads)
            dist.all_reduce(flat, group=self.dp_group)
            for grad, total in zip(grads, flat / dist.get_world_size(self.dp_group)):
                grad.copy_(total)
        return True


def _check_in_backward(config: TrainConfig) -> None:
    """What --optimizer-in-backward cannot do: each update needs the whole step's gradient of its own
    parameter, and nothing else, at the moment FSDP2 hands it over."""
    refusals = [
        (config.optim.clip_grad_norm is not None, "--clip-grad-norm needs every gradient's norm before any update"),
        (config.grad_accum > 1, "--grad-accum would update on the first micro-step's gradient"),
        (config.compute.precision == "fp16", "fp16's loss scaler checks every gradient for inf before the update"),
        (config.model.tp > 1, "with --tp it is not built (the replicated parameters' gradients are not checked)"),
        (config.per_step, "per-step fault tolerance averages the gradients across groups after the backward pass"),
    ]
    for refused, why in refusals:
        if refused:
            raise UsageError(f"bad value optimizer_in_backward=True: {why}")


class TensorParallelStrategy(ReplicaStrategy):
    name = "tp"
    splits_model = True
    # The split layers' parameters are DTensors, the rest (embeddings, norms, head) plain tensors, and
    # torch's foreach kernels behind clip_grad_norm_ and the fp16 scaler's unscale refuse the mix.

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        if config.compute.precision == "fp16":
            raise UsageError("bad value precision='fp16': the loss scaler cannot unscale tp's mix of split "
                             "(DTensor) and replicated gradients; use bf16 or fp32")

    @classmethod
    def mesh(cls, config: TrainConfig, world: int) -> MeshDims:
        return MeshDims(tp=world)

    @classmethod
    def planned_meshes(cls, workers: int) -> list[MeshDims]:
        return [MeshDims(tp=tp) for tp in split_degrees(workers)]

    @classmethod
    def layout_name(cls, mesh: MeshDims) -> str:
        return f"{cls.name} {mesh.tp}"

    @classmethod
    def data_shards(cls, config: TrainConfig, world: int) -> list[int | None]:
        return [0] * world  # the ranks compute one replica together, on the same batch

    @classmethod
    def check_model(cls, config: TrainConfig, model: nn.Module, world: int,
                    task_tp_plan: dict[str, str] | None = None) -> None:
        check_tp_divides(model, tp_plan(model, task_tp_plan), world)

    def wrap(self, model: nn.Module) -> nn.Module:
        self.tp_plan = self.announce(tp_plan(model, self.declared_tp_plan))
        check_tp_divides(model, self.tp_plan, self.env.world_size)
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("tp",))
        return apply_tp(model, mesh, self.tp_plan)

