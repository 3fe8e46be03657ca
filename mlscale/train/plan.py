"""The job plan: the strategy, the processes and their roles, the mesh and the batch, resolved once.

``fit`` makes the plan (``planner.plan_job``) before any process starts and writes it to
``RUN_DIR/plan.json``; the launcher, the workers, the trainer, the strategies, the failure report and
``mlscale k8s train`` read it and derive nothing again. This module is the plan's data only, so that
the strategies, which describe their layout in its terms, can import it. The words
(docs/architecture.md, "The job's words"):

- **process** (rank): one OS process of a process group; **world**: the processes of one group (one
  launch: torchrun's ``WORLD_SIZE``). Under per-step fault tolerance every **replica group** is a process
  group of its own (``--group-size`` processes) and the job has ``--workers`` of them.
- **mesh**: the degrees of parallelism of the job's training processes, torchtitan's ``ParallelDims``:
  ``dp_replicate x dp_shard x tp x pp``. A **replica** is one copy of the model being trained on its own
  data: ``tp x pp`` processes (``dp_shard`` processes share one under fsdp, each on its own data).
- **data shard**: what one data-parallel member reads: ``dp_replicate x dp_shard`` of them, each
  ``--batch-size`` samples per micro-step; the global batch is their sum over ``--grad-accum``
  micro-steps. Ranks of one replica that split the model (tp, pp) read the same shard.
- **server** (``--strategy ps``): a process that holds parameters and reads no data.
- **workers** (``--workers``): what the user asks for; each strategy says what it counts (above).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlscale.common.io import atomic_write_json


@dataclass(frozen=True)
class MeshDims:
    """Degrees of parallelism: ``dp_replicate x dp_shard x tp x pp`` training processes. Today's
    strategies each use a subset (ddp: replicate; fsdp: shard, or replicate x shard as HSDP; tp; pipeline:
    replicate x pp); combining them (fsdp x tp, pp x dp) is a mesh of several degrees > 1."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name, degree in asdict(self).items():
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"mesh degree {name}={degree!r}: a whole number of at least 1")

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """Members reading different data: the data shards."""
        return self.dp_replicate * self.dp_shard

    def active(self) -> dict[str, int]:
        """The degrees above 1, by name, in mesh order (what a device mesh would be built from)."""
        return {name: degree for name, degree in asdict(self).items() if degree > 1}


@dataclass(frozen=True)
class JobPlan:
    """Everything about a job's layout and batch, resolved once from its configuration."""

    strategy: str
    fault_tolerance: str  # restart | per-step
    world: int  # processes of one process group (a replica group's under per-step)
    replica_groups: int  # process groups of the job: 1, or --workers under per-step
    servers: int  # parameter server processes (of each group), on top of the mesh
    mesh: MeshDims  # of the whole job's training processes (replica groups included in dp_replicate)
    rank_shards: list[int | None]  # each rank's data shard within its group (None: reads no data)
    checkpoint_ranks: list[int]  # the ranks of a group that hold training state and write checkpoints
    batch_size: int  # samples per data shard per micro-step (--batch-size)
    grad_accum: int  # micro-steps per optimizer step
    total_steps: int | None = None  # optimizer steps of the job (None: the data was not read, as for k8s)
    train_samples: int | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """A plan that cannot be run is refused when made (or read back), not when a worker trips on it."""
        problems = []
        if self.world < 1 or self.replica_groups < 1 or not 0 <= self.servers < self.world:
            problems.append(f"world {self.world}, replica groups {self.replica_groups}, servers {self.servers}")
        if len(self.rank_shards) != self.world:
            problems.append(f"{len(self.rank_shards)} ranks' data shards for a world of {self.world}")
        if self.mesh.size != (self.world - self.servers) * self.replica_groups:
            problems.append(f"a mesh of {self.mesh.size} training processes for {self.replica_groups} group(s) of "
                            f"{self.world - self.servers}")
        if not self.checkpoint_ranks or any(not 0 <= rank < self.world for rank in self.checkpoint_ranks):
            problems.append(f"checkpoint ranks {self.checkpoint_ranks} outside a world of {self.world}")
        if self.batch_size < 1 or self.grad_accum < 1:
            problems.append(f"batch size {self.batch_size} x {self.grad_accum} micro-steps")
        if problems:
            raise ValueError(f"an inconsistent {self.strategy} plan: {'; '.join(problems)}")

    @property
    def processes(self) -> int:
        """Every process of the job."""
        return self.world * self.replica_groups

    @property
    def shards_per_group(self) -> int:
        return len({shard for shard in self.rank_shards if shard is not None})

    @property
    def data_shards(self) -> int:
        """Data shards of the whole job: the members that read different data."""
        return self.shards_per_group * self.replica_groups

    @property
    def step_batch(self) -> int:
        """Samples per data shard per optimizer step."""
        return self.batch_size * self.grad_accum

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, all shards together."""
        return self.step_batch * self.data_shards

    def data_ranks(self) -> list[int]:
        """The job-wide ranks (group x world + rank) that read data."""
        return [group * self.world + rank for group in range(self.replica_groups)
                for rank, shard in enumerate(self.rank_shards) if shard is not None]

    def shard_of(self, rank: int, group: int = 0) -> int | None:
        """The job-wide data shard of ``rank`` in replica group ``group`` (None: reads no data)."""
        own = self.rank_shards[rank]
        return None if own is None else own + group * self.shards_per_group

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.update(processes=self.processes, data_shards=self.data_shards, global_batch=self.global_batch,
                      mesh_active=self.mesh.active())
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> JobPlan:
        names = set(cls.__dataclass_fields__)
        fields = {key: value for key, value in values.items() if key in names}
        return cls(**{**fields, "mesh": MeshDims(**fields["mesh"])})

    def write(self, path: Path) -> None:
        atomic_write_json(path, self.as_dict())

    @classmethod
    def read(cls, path: Path) -> JobPlan:
        return cls.from_dict(json.loads(path.read_text()))
