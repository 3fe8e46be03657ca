"""The strategy interface: how a model is spread over processes, who does what, and how they talk.

The trainer owns the loop, the data and checkpoints, and records through ``Records``; a strategy owns
one training step. The trainer calls only what is here and never asks which strategy runs. A strategy
may give ranks different roles: ranks that read data and compute gradients (every rank under ddp; the
workers of a parameter server; the first pipeline stage), and ranks that read none (the servers). Only
ranks that *keep records* take part in logs and the report, and the strategy says how their records are
shared; *checkpoint ranks* write their own part of every checkpoint (torch.distributed.checkpoint).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn

from mlscale.config import Options, TrainConfig
from mlscale.data import Position
from mlscale.train.checkpoint import TrainState
from mlscale.train.dist import DistEnv
from mlscale.train.plan import JobPlan, MeshDims
from mlscale.train.timing import CommTimer, StepTimes


class Shared(Protocol):
    """A record that record keepers share (``Strategy.share``): it packs itself into floats for the
    collective and is read back from them; nothing else knows the positions."""

    def to_floats(self) -> list[float]: ...

    @classmethod
    def from_floats(cls: type[SharedT], values: Sequence[float]) -> SharedT: ...


SharedT = TypeVar("SharedT", bound=Shared)


@dataclass(frozen=True)
class Batch:
    """One step's input on a data rank, with what the trainer measured before handing it over."""

    inputs: Any  # on the rank's device: a tensor, a tuple or a dict of tensors (mlscale.data.batches)
    targets: Any  # a tensor or a dict of tensors
    position: Position  # the loader's position after this batch: where a resume goes on from
    started: float  # perf_counter() when the step began (before the batch was loaded)
    data_ms: float  # time spent waiting for the batch
    ids: torch.Tensor | None = None  # the data set indices of the batch, where the loader knows them


@dataclass
class StepRow:
    """One data rank's step, measured by that rank: its loss and where its time went."""

    rank: int
    loss: float | torch.Tensor | None  # a tensor stays on the device until a log line needs it; None: this
    # rank computes no loss (a pipeline stage before the last)
    times: StepTimes


@dataclass
class StepResult:
    """What one call of ``Strategy.step`` did, as far as this rank knows."""

    step: int  # global steps (model updates) completed so far
    done: bool  # training has reached its end
    samples: int = 0  # samples whose gradients the completed global step(s) applied
    rows: list[StepRow] = field(default_factory=list)  # steps measured, of this or other ranks
    positions: dict[int, Position] = field(default_factory=dict)  # data shard -> position, as applied
    applied: bool = True  # False: the step was discarded (a peer failed during it) and its batch is redone


class JobFinished(Exception):
    """Raised by ``begin_step`` in a process that finds the job already finished without it (a replacement
    that came too late to rejoin): it leaves quietly, exit 0."""


@dataclass(frozen=True)
class StepStart:
    """What ``Strategy.begin_step`` tells the trainer about the step about to begin."""

    step: int  # the global step about to be trained
    # A process that has just received the job's state from a peer (per-step fault tolerance) jumps to
    # that step: its data position (global, the same for every shard) and the samples trained so far.
    position: Position | None = None
    samples_seen: int | None = None


@dataclass
class Learner:
    """The update rule for a set of parameters: optimizer, LR schedule, loss scaler, autocast."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    precision: str
    device_type: str
    clip_grad_norm: float | None = None  # --clip-grad-norm: the gradients' global L2 norm is clipped to this
    skipped_steps: int = 0  # fp16: steps the loss scaler skipped (inf or NaN gradients), each halving the scale
    poison_next: bool = False  # --fault inf_grad: the next backward's loss is multiplied by inf

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor, accumulate: bool = False) -> None:
        """Gradients of ``loss`` into ``.grad``: fresh, or added to what is there (``accumulate``)."""
        if not accumulate:
            self.optimizer.zero_grad(set_to_none=True)
        if self.poison_next:
            loss, self.poison_next = loss * float("inf"), False
        self.scaler.scale(loss).backward()

    def apply(self) -> None:
        """Step the optimizer on the gradients in ``.grad``, then the scaler and the schedule. The
        weights (and the optimizer's state) stay in the model's dtype: autocast computes in bf16/fp16
        on copies, so fp32 weights are the master weights. Under fp16 a step whose gradients hold an
        inf or NaN is skipped by the scaler, which halves its scale (and grows it again after 2,000
        good steps)."""
        before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        if self.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            # The norm over all parameters; sharded (DTensor) gradients are reduced across their ranks.
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if before is not None and self.scaler.get_scale() < before:
            self.skipped_steps += 1
        self.scheduler.step()

    def precision_report(self) -> dict[str, Any]:
        weights = next((p.dtype for group in self.optimizer.param_groups for p in group["params"]), None)
        return {"precision": self.precision, "master_weights": str(weights).removeprefix("torch."),
                "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None,
                "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])


MakeLearner = Callable[[Iterable[nn.Parameter]], Learner]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Setup:
    """What a strategy is given once, before the first step."""

    model: nn.Module  # the plain model, built with the same seed on every rank
    build_model: Callable[[], nn.Module]  # another plain model (different weights), to gather a split one into
    make_learner: MakeLearner
    loss_fn: LossFn
    total_steps: int
    start_step: int
    global_batch: int
    # A strategy that splits the model (``splits_model``) is given it with its parameters on the meta device
    # when distributed, and fills what each rank holds: from ``full_weights()`` (the whole model's state dict,
    # built as one process builds it: called on rank 0 only) or by the model's own init (mlscale.train.materialize).
    weight_init: str = "full"  # full | sharded
    full_weights: Callable[[], dict[str, torch.Tensor]] = dict
    tp_plan: dict[str, str] | None = None  # the task's tensor-parallel plan, if it declares one
    # One batch of example inputs as the model receives them (held-out samples, transformed, in the job's
    # dtype, on this rank's device), for a strategy that traces the model (a pipeline, on a microbatch).
    sample_inputs: Any = None  # a tensor, a tuple or a dict of tensors (mlscale.data.batches)
    # Called by a strategy once this process can be seen by its peers (per-step fault tolerance: its
    # torchft Manager heartbeats to the lighthouse); the trainer's fault injector listens (rejoin_by).
    ready: Callable[[], None] = lambda: None


def split_degrees(workers: int) -> list[int]:
    """The degrees a job of ``workers`` processes can be split over: its divisors from 2 (a job may use fewer
    processes than it has)."""
    return [degree for degree in range(2, workers + 1) if workers % degree == 0]


class Strategy(ABC):
    name: ClassVar[str]
    # The options model this strategy owns (its group in TrainConfig, refused under other strategies);
    # which shared options apply to which strategy is declared with the options (mlscale.config: ``only``).
    options: ClassVar[type[Options] | None] = None
    # Under this strategy a distributed model is split, so it is built on the meta device (no memory).
    splits_model: ClassVar[bool] = False
    # A restarted process gets the training state from a live peer (per-step fault tolerance), not from
    # the newest checkpoint; the others never restart.
    recovers_live: ClassVar[bool] = False
    # Why ``mlscale plan`` does not predict this strategy's memory ("": it does, on ``planned_meshes``).
    unplanned: ClassVar[str] = ""
    # Options ``mlscale plan`` may be given for other strategies' layouts that this one's leave out (one plan
    # covers every strategy: an option of one strategy only goes to the layouts it applies to).
    plan_ignores: ClassVar[tuple[str, ...]] = ()

    def __init__(self, env: DistEnv, config: TrainConfig, plan: JobPlan) -> None:
        self.env, self.config, self.plan = env, config, plan
        self.comm = CommTimer()
        self.shards = plan.shards_per_group  # data shards of this process group, one per replica

    # -- layout (asked only by the job plan, plan_job, before any process starts) ------------------
    @classmethod
    def world_size(cls, config: TrainConfig) -> int:
        """Processes the job needs for ``config.workers`` data-parallel workers."""
        return config.workers

    @classmethod
    def mesh(cls, config: TrainConfig, world: int) -> MeshDims:
        """The degrees of parallelism of one process group of ``world`` processes (servers left out)."""
        return MeshDims(dp_replicate=world)

    @classmethod
    def data_shards(cls, config: TrainConfig, world: int) -> list[int | None]:
        """Each rank's data shard (``None``: reads no data). One shard per data-parallel replica: ranks
        of one replica (tensor-parallel peers, pipeline stages) read the same shard."""
        return list(range(world))

    @classmethod
    def checkpoint_ranks(cls, config: TrainConfig, world: int) -> list[int]:
        """The ranks that hold training state and write checkpoints together (the others only read)."""
        return list(range(world))

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        """Refuse, with a ``UsageError``, what needs the world to check (whether an option applies to the
        strategy at all is declared with it in mlscale.config: ``only``)."""
        return None

    @classmethod
    def checks_model(cls, config: TrainConfig) -> bool:
        """Whether ``check_model`` has anything to check for ``config`` (else the model is not built before
        the workers start: building one can mean importing a large library)."""
        return cls.check_model.__func__ is not Strategy.check_model.__func__  # type: ignore[attr-defined]

    @classmethod
    def check_model(cls, config: TrainConfig, model: nn.Module, world: int,
                    task_tp_plan: dict[str, str] | None = None) -> None:
        """Refuse a model this strategy cannot split (given on the meta device: structure, no weights;
        ``task_tp_plan``: the task's tensor-parallel plan, if it declares one)."""
        return None

    @classmethod
    def check_data(cls, config: TrainConfig, data: Any) -> None:
        """Refuse training data this strategy cannot take (a Dataset, in memory or Parquet), before any
        process starts."""
        return None

    # -- the layouts mlscale plan predicts (asked by mlscale.train.memory_plan, before anything runs) ---
    @classmethod
    def planned_meshes(cls, workers: int) -> list[MeshDims]:
        """The meshes a job of ``workers`` processes may run this strategy on, each predicted by ``mlscale
        plan``: by default every process a replica of its own (the default ``mesh``)."""
        return [] if cls.unplanned else [MeshDims(dp_replicate=workers)]

    @classmethod
    def layout_options(cls, mesh: MeshDims) -> dict[str, Any]:
        """The ``mlscale train`` options (besides ``--strategy``) that run this strategy on ``mesh``: the
        inverse of ``mesh``, so that a planned layout is one ``mlscale train`` can be asked for."""
        return {"workers": mesh.size}

    @classmethod
    def layout_name(cls, mesh: MeshDims) -> str:
        """How ``mlscale plan`` names this strategy on ``mesh`` (the degrees a user would choose)."""
        return cls.name if mesh.size == 1 else f"{cls.name} x{mesh.size}"

    @classmethod
    def check_planned(cls, config: TrainConfig, model: nn.Module, world: int,
                      task_tp_plan: dict[str, str] | None = None) -> None:
        """``check_model`` as ``mlscale plan`` makes it, of a layout it predicts without running the strategy
        (a strategy whose check needs more than the plan's fake step checks what the plan relies on)."""
        cls.check_model(config, model, world, task_tp_plan)

    @property
    def keeps_records(self) -> bool:
        """Whether this rank takes part in logs, checkpoints and the report."""
        return True

    @property
    def writes_records(self) -> bool:
        """Whether this rank writes the run directory's records now (metrics lines, console, report): rank 0,
        or under per-step fault tolerance whichever replica leads the current quorum."""
        return self.env.is_main

    @property
    def saves_checkpoints(self) -> bool:
        """Whether this checkpoint rank writes its part of a checkpoint now (all of them, unless replica
        groups hold the same state and one of them writes it)."""
        return True

    def begin_step(self, position: Position | None, samples_seen: int) -> StepStart | None:
        """Called before the next batch is read, with the trainer's place now (its shard's data position,
        the samples trained): ``None``, the next step follows the last. Under per-step fault tolerance
        the quorum forms here, and a process that has just received the state from a peer is told where
        to go on from (the peer's place). May raise ``JobFinished``."""
        return None

    def log_fields(self, step: int, since: int) -> dict[str, Any]:
        """Strategy-specific fields for the metrics line of ``step``, about the steps after ``since``."""
        return {}

    # -- the step ----------------------------------------------------------------------------------
    @abstractmethod
    def setup(self, setup: Setup) -> None:
        """Place the model and build its update rule(s)."""

    @abstractmethod
    def step(self, batch: Batch | None) -> StepResult:
        """One step: a batch on data ranks, ``None`` on ranks that read no data."""

    # -- records (called on record-keeping ranks only, all of them together) -----------------------
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the latest update used."""

    def share(self, kind: type[SharedT], records: Sequence[SharedT]) -> list[SharedT]:
        """Every record keeper's records of ``kind``, in rank order (a collective among record keepers):
        each travels as its own ``to_floats()`` and is read back by ``kind.from_floats``."""
        return [kind.from_floats(row) for row in self.gather_floats([record.to_floats() for record in records])]

    @abstractmethod
    def gather_floats(self, rows: list[list[float]]) -> list[list[float]]:
        """The collective under ``share``: every record keeper's rows of floats, in rank order."""

    @abstractmethod
    def train_state(self) -> TrainState:
        """This rank's part of the training state for a checkpoint (model, optimizer, schedule, scaler),
        keyed by the unsplit model's names; sharded tensors stay ``DTensor``. Called on checkpoint ranks."""

    def state_template(self) -> TrainState:
        """Tensors to load a checkpoint into, in this rank's layout (every rank that resumes)."""
        return self.train_state()

    @abstractmethod
    def load_train_state(self, state: TrainState) -> None:
        """Take the filled ``state_template()``; its ``meta`` is this rank's saved one (or rank 0's)."""

    @abstractmethod
    def full_model(self) -> nn.Module | None:
        """The plain trained model on rank 0 (``None`` elsewhere). A collective among record keepers."""

    def evaluator(self) -> nn.Module | None:
        """For ``--eval-every``: the module this rank runs the held-out data through (all record keepers
        together, as a sharded model's forward is collective); ``None``: this rank takes no part."""
        return None

    def memory(self) -> dict[str, float]:
        """MB of this rank's parameters, gradients and optimizer state (``mlscale.train.memory``),
        measured after a step; ``{}`` where a strategy does not measure it."""
        return {}

    @property
    def simulates_compute(self) -> bool:
        """Whether the strategy spends ``--simulated-compute-ms`` itself (else the trainer sleeps it)."""
        return False

    def report(self) -> dict[str, Any]:
        """Strategy-specific fields for ``report.json`` (rank 0)."""
        return {}

    def close(self) -> None:
        """Called once on every rank when training has ended."""
        return None
