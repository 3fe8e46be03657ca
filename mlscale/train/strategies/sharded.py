"""Strategies that split the model itself across ranks, each rank running the whole step.

- ``fsdp``: fully sharded data parallelism (ZeRO-3) with FSDP2 ``fully_shard``. Every rank holds
  1/N of the parameters, gradients and optimizer state; a block's parameters are all-gathered just
  before it runs and freed after, gradients are reduce-scattered. Each rank reads its own data shard,
  so it trains like ddp with N workers, on about 1/N of the memory for the training state.
- ``tp``: tensor parallelism (Megatron-LM) with ``torch.distributed.tensor.parallel``. The attention
  heads and the MLP columns of every transformer block are split over the N ranks, which compute one
  replica together, on the same batch: one data shard, trained like one worker.

Both are applied to the plain model from outside (``mlscale.train.parallelize``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mlscale.config import TrainConfig
from mlscale.errors import UsageError
from mlscale.train.parallelize import apply_fsdp, apply_tp, check_tp_divides, tp_plan
from mlscale.train.plan import MeshDims
from mlscale.train.strategies.replica import ReplicaStrategy


class FSDPStrategy(ReplicaStrategy):
    name = "fsdp"

    @classmethod
    def mesh(cls, config: TrainConfig, world: int) -> MeshDims:
        return MeshDims(dp_shard=world)

    def wrap(self, model: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("dp",))
        return apply_fsdp(model, mesh)

    def synchronising(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if self.env.distributed:
            self.module.set_requires_gradient_sync(sync)  # FSDP2: no reduce-scatter until the last micro-step
        return contextlib.nullcontext()


class TensorParallelStrategy(ReplicaStrategy):
    name = "tp"
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
    def data_shards(cls, config: TrainConfig, world: int) -> list[int | None]:
        return [0] * world  # the ranks compute one replica together, on the same batch

    @classmethod
    def check_model(cls, config: TrainConfig, model: nn.Module, world: int) -> None:
        tp_plan(model)
        check_tp_divides(model, world)

    def wrap(self, model: nn.Module) -> nn.Module:
        check_tp_divides(model, self.env.world_size)
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("tp",))
        return apply_tp(model, mesh)
