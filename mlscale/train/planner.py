"""The job planner: a configuration's plan (``plan.JobPlan``), from the layout its strategy asks for.

It asks the strategies (``strategies.strategy_for``) and so sits above them; the plan it returns is
plain data that the strategies themselves read.
"""

from __future__ import annotations

import math
import os

from mlscale.config import TrainConfig
from mlscale.data.parquet import ParquetData, epoch_steps_for
from mlscale.data.tensors import TensorData
from mlscale.train.dist import under_launcher
from mlscale.train.plan import JobPlan, MeshDims
from mlscale.train.strategies import strategy_for


def total_steps(config: TrainConfig, data: TensorData | ParquetData, shards: int) -> int:
    """Optimizer steps of the job: ``--steps``, else ``--epochs`` (10) over ``shards`` data shards."""
    if config.steps is not None:
        return config.steps
    epochs = config.epochs if config.epochs is not None else 10.0
    return max(1, math.ceil(epochs * epoch_steps_for(data, shards, config.step_batch, config.seed)))


def launch_world(config: TrainConfig) -> int:
    """Processes of one process group: torchrun's ``WORLD_SIZE`` under a launcher, else what the
    strategy needs for ``--workers``."""
    if under_launcher() and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return strategy_for(config).world_size(config)


def plan_job(config: TrainConfig, world: int | None = None,
             data: TensorData | ParquetData | None = None) -> JobPlan:
    """The plan of ``config`` for process groups of ``world`` processes (default: ``launch_world``),
    with its length when the training ``data`` is given."""
    strategy = strategy_for(config)
    world = launch_world(config) if world is None else world
    rank_shards = strategy.data_shards(config, world)
    groups = config.replica_groups
    group_mesh = strategy.mesh(config, world)  # of one process group
    mesh = MeshDims(dp_replicate=group_mesh.dp_replicate * groups, dp_shard=group_mesh.dp_shard, tp=group_mesh.tp,
                    pp=group_mesh.pp)
    plan = JobPlan(strategy=config.strategy, fault_tolerance=config.recovery.fault_tolerance, world=world,
                   replica_groups=groups, servers=world - group_mesh.size, mesh=mesh, rank_shards=rank_shards,
                   checkpoint_ranks=strategy.checkpoint_ranks(config, world), batch_size=config.batch_size,
                   grad_accum=config.grad_accum)
    if data is None:
        return plan
    return JobPlan(**{**plan.__dict__, "total_steps": total_steps(config, data, plan.data_shards),
                      "train_samples": len(data)})
