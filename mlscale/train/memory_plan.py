"""What each rank of a job will hold, for every strategy and degree, found before anything runs.

``mlscale plan`` runs one training step of the task's own model for every layout a job of ``--workers``
processes allows (ddp; fsdp over N; tp over T when the model has a tensor-parallel plan; fsdp x tp;
pipeline over P stages when the model has repeated blocks) on fake tensors: the model is built on the meta
device, split by the same functions a run splits it with (``mlscale.train.parallelize``: the real
``fully_shard`` and ``parallelize_module``, on a fake process group of the layout's size standing for rank
0), and given storage only in ``FakeTensorMode``, where every operation computes shapes, never values. So
nothing is allocated and nothing is communicated, yet the forward, the backward and the optimizer's first
step are the ones a run executes, and the bytes are counted by the functions that write ``report.json``'s
``memory`` (``mlscale.train.memory``): parameters, gradients and optimizer state as the distinct storages
this rank holds (a shard counts its local part), activations as what autograd keeps for the backward pass.
A prediction and a measurement therefore count the same things, for any model the task builds (Hugging
Face models included), without a formula per architecture.

Pipeline layouts are derived from one fake step of the unsplit model: its repeated blocks (the container
``parallelize.block_container`` finds) are balanced over the stages by parameter count, the parts before the
blocks go to the first stage and the parts after them to the last (a weight tied across stages is held by
both); a stage's activations are what its modules save for one microbatch, times the microbatches in
flight on it (every one under gpipe; under 1f1b at most ``stages - s`` on stage ``s``).
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from mlscale.config import TrainConfig, flatten, merged, read_config_file, validated
from mlscale.data.batches import Tree, call_model, chunk, rows, tree_map
from mlscale.data.dataset import MapData
from mlscale.errors import UsageError
from mlscale.tasks import Task, make_task
from mlscale.train.materialize import build_on_meta
from mlscale.train.memory import SavedActivations, storage_bytes
from mlscale.train.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tp,
    block_container,
    param_count,
    tp_plan,
)
from mlscale.train.plan import MeshDims
from mlscale.train.stages import balance
from mlscale.train.strategies import STRATEGIES
from mlscale.train.strategy import Strategy
from mlscale.train.trainer import build_optimizer

MB = 2**20


@dataclass(frozen=True)
class Layout:
    """A strategy on a mesh (its degrees: data-parallel replicas or shards, tensor-parallel ranks per block,
    pipeline stages), as the strategy plans it (``planned_meshes``)."""

    strategy: type[Strategy]
    mesh: MeshDims

    @property
    def splitting(self) -> int:
        """The processes one step's model is split over (sharded, or its blocks split): the fake group."""
        return self.mesh.dp_shard * self.mesh.tp

    @property
    def name(self) -> str:
        return self.strategy.layout_name(self.mesh)

    def options(self) -> dict[str, Any]:
        """The ``mlscale train`` options of this layout."""
        return {"strategy": self.strategy.name, **self.strategy.layout_options(self.mesh)}


@dataclass
class RankBytes:
    """One rank's (or pipeline stage's) bytes, in ``report.json``'s terms; ``checkpointed``: the
    activations under activation checkpointing (``None`` where the strategy does not take it)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    checkpointed: int | None = None
    stage: int | None = None

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations

    @property
    def total_checkpointed(self) -> int | None:
        return None if self.checkpointed is None else self.state + self.checkpointed

    def as_mb(self) -> dict[str, Any]:
        """The same keys as ``report.json``'s ``memory`` rows, and the totals."""
        row: dict[str, Any] = {} if self.stage is None else {"stage": self.stage}
        row.update(params_mb=self.params / MB, grads_mb=self.grads / MB, optimizer_mb=self.optimizer / MB,
                   state_mb=self.state / MB, activations_mb=self.activations / MB,
                   activations_checkpointed_mb=None if self.checkpointed is None else self.checkpointed / MB,
                   total_mb=self.total / MB,
                   total_checkpointed_mb=None if self.checkpointed is None else self.state / MB + self.checkpointed
                   / MB)
        return row


@dataclass
class LayoutPlan:
    """A layout's prediction: rank 0 (the largest shard under fsdp), or every stage of a pipeline; or
    why the layout cannot run this model (``refused``)."""

    layout: Layout
    ranks: list[RankBytes] = field(default_factory=list)
    refused: str | None = None

    @property
    def largest(self) -> RankBytes | None:
        """The rank that needs the most (what a device of a given size must hold)."""
        return max(self.ranks, key=lambda rank: rank.total) if self.ranks else None

    def fits(self, limit_mb: float | None) -> str | None:
        """``yes``, ``with checkpointing`` (only once activations are recomputed), ``no``; ``None``
        without a limit or for a refused layout."""
        largest = self.largest
        if limit_mb is None or largest is None:
            return None
        limit = limit_mb * MB
        if largest.total <= limit:
            return "yes"
        checkpointed = max((rank.total_checkpointed or rank.total for rank in self.ranks), default=None)
        if largest.checkpointed is not None and checkpointed is not None and checkpointed <= limit:
            return "with checkpointing"
        return "no"

    def as_dict(self, limit_mb: float | None) -> dict[str, Any]:
        largest = self.largest
        return {"layout": self.layout.name, **self.layout.options(), "tp": self.layout.mesh.tp,
                "stages": self.layout.mesh.pp, "refused": self.refused,
                "per_rank": None if largest is None else largest.as_mb(),
                "ranks": [rank.as_mb() for rank in self.ranks], "fits": self.fits(limit_mb)}


@dataclass
class MemoryPlan:
    """Every layout's prediction for one task, batch and set of options."""

    task: str
    config: TrainConfig
    checkpointing: str  # the activation checkpointing the *_checkpointed figures are for
    layouts: list[LayoutPlan]
    seconds: float

    @property
    def limit_mb(self) -> float | None:
        return self.config.compute.memory_limit_mb

    def as_dict(self) -> dict[str, Any]:
        config = self.config
        return {"task": self.task, "task_options": config.task_options, "workers": config.workers,
                "batch_size": config.batch_size, "grad_accum": config.grad_accum, "dtype": config.compute.dtype,
                "precision": config.compute.precision, "optimizer": config.optim.optimizer,
                "activation_checkpointing": self.checkpointing, "memory_limit_mb": self.limit_mb,
                "microbatches": config.pipeline.microbatches, "schedule": config.pipeline.schedule,
                "layouts": [layout.as_dict(self.limit_mb) for layout in self.layouts],
                "seconds": self.seconds}


# -- which layouts a job of N processes allows ---------------------------------------------------------
def planned() -> list[type[Strategy]]:
    """The strategies ``mlscale plan`` predicts, in the order of their table."""
    return [strategy for strategy in STRATEGIES.values() if not strategy.unplanned]


def candidate_layouts(workers: int, strategies: Sequence[type[Strategy]]) -> list[Layout]:
    """Every mesh each strategy plans for a job of ``workers`` processes (ddp on all of them; fsdp, tp and
    pipeline over every divisor from 2; fsdp x tp over every split into two degrees from 2), in table order."""
    return [Layout(strategy, mesh) for strategy in planned() if strategy in strategies
            for mesh in strategy.planned_meshes(workers)]


def _strategies(names: str) -> list[type[Strategy]]:
    """``--strategy``'s comma-separated names, each a strategy ``mlscale plan`` predicts."""
    known = {strategy.name: strategy for strategy in planned()}
    unplanned = "; ".join(f"{strategy.name} {strategy.unplanned}" for strategy in STRATEGIES.values()
                          if strategy.unplanned)
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    for name in chosen:
        if name not in known:
            raise UsageError(f"bad value strategy={name!r}: mlscale plan plans {', '.join(known)} ({unplanned})")
    return [known[name] for name in chosen]


# -- fake tensors on a fake process group ----------------------------------------------------------------
@contextlib.contextmanager
def fake_world(processes: int) -> Iterator[None]:
    """A process group of ``processes`` ranks in which this process is rank 0 and every collective returns
    at once without moving data (torch's ``fake`` backend): what lets ``fully_shard`` and
    ``parallelize_module`` split a model as on that many ranks, in one process."""
    if processes == 1:
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=processes)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_mode() -> Any:
    # The meta-built model is turned into fake tensors inside the mode (to_empty), so meta and real
    # inputs (a model's real buffers) are taken as they come.
    return FakeTensorMode(allow_non_fake_inputs=True)


Shape = tuple[torch.Size, torch.dtype]


def _sample_batch(task: Task, dtype: torch.dtype, rows: int) -> tuple[Tree, Tree]:
    """A batch of training samples and targets as the model receives them (after the task's transform, in
    the run's dtype), of which only the shapes after the first dimension and the dtypes count: one sample
    of in-memory or Parquet data; of a Dataset, its first ``rows`` items collated (padded as a run pads)."""
    data = task.train_data()
    if isinstance(data, MapData):
        return data.to(dtype).batch(range(min(rows, len(data))))
    (input_shape, input_dtype), (target_shape, target_dtype) = _sample_shape(task, dtype)
    return torch.empty((1, *input_shape), dtype=input_dtype), torch.empty((1, *target_shape), dtype=target_dtype)


def _sample_shape(task: Task, dtype: torch.dtype) -> tuple[Shape, Shape]:
    """The shape and dtype of one training sample and its target, as the model receives them (after the
    task's transform, in the run's dtype)."""
    data = task.train
    inputs = getattr(data, "inputs", None)
    if inputs is None:  # Parquet: the first row group's first row
        inputs, targets = data.read(data.groups[0])
    else:
        targets = data.targets
    sample, target = inputs[0], targets[0]
    if task.transform is not None:
        sample = task.transform(sample)
    cast = [(t.shape, dtype if t.is_floating_point() else t.dtype) for t in (sample, target)]
    return cast[0], cast[1]


def _fake_batch(example: tuple[Tree, Tree], samples: int, chunks: int) -> tuple[Tree, Tree]:
    """The first micro-step's inputs and targets, chunks of a step batch of ``samples`` shaped like
    ``example`` as a run's loader gives it (so a saved input counts the batch's storage, as it does in a
    run). Call in fake mode."""
    inputs, targets = tree_map(lambda t: torch.empty((samples, *t.shape[1:]), dtype=t.dtype), example)
    return chunk(inputs, chunks)[0], chunk(targets, chunks)[0]


def _autocast(config: TrainConfig) -> contextlib.AbstractContextManager[Any]:
    """The run's autocast (``Learner.autocast``), on the CPU: the bytes are the device's either way."""
    if config.compute.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if config.compute.precision == "bf16" else torch.float16
    return torch.autocast("cpu", dtype=dtype)


@contextlib.contextmanager
def eager_mask_paths() -> Iterator[None]:
    """Hugging Face models build their attention mask as a run does, although their inputs are fake.

    ``transformers.masking_utils`` treats a fake tensor as a sign of ``torch.compile`` tracing and then
    takes the tracing path: the positions taken for packed sequences and an explicit causal mask passed
    to SDPA instead of ``is_causal``, with keys and values repeated for every query head. A run in eager
    mode never takes it (``model(inputs)`` numbers positions 0..n-1: nothing is packed), and that path
    saves other tensors for the backward pass. While open, the masking code asks only whether something
    is being traced (dynamo, jit, a CUDA graph), not whether a tensor is fake, and finds no packed
    sequences in fake positions. A model whose mask then needs values (a padding mask) fails as any read
    of a fake value fails, and its layout is reported as not estimated."""
    masking = sys.modules.get("transformers.masking_utils")
    tracing = getattr(masking, "is_tracing", None)
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or tracing is None or packed is None:
        yield
        return

    def tracing_anything(tensor: object = None) -> bool:
        return bool(tracing(None))

    def packed_sequences(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return None if isinstance(position_ids, FakeTensor) else packed(position_ids, *args, **kwargs)

    masking.is_tracing, masking.find_packed_sequence_indices = tracing_anything, packed_sequences
    try:
        yield
    finally:
        masking.is_tracing, masking.find_packed_sequence_indices = tracing, packed


# -- one layout ------------------------------------------------------------------------------------------
class _Planner:
    """The task, its sample shape and the options; one fake step per layout."""

    def __init__(self, task: Task, config: TrainConfig, checkpointing: str) -> None:
        self.task, self.config, self.checkpointing = task, config, checkpointing
        self.dtype = getattr(torch, config.compute.dtype)
        self.example = _sample_batch(task, self.dtype, config.step_batch)

    def build(self) -> nn.Module:
        return build_on_meta(lambda: self.task.build_model().to(dtype=self.dtype))

    def split(self, model: nn.Module, mesh: MeshDims) -> None:
        """What the strategies' ``wrap`` does, on the fake group: tensor parallelism over ``tp`` ranks, then
        FSDP2 over ``dp_shard`` (torchtitan's order), as the layout's mesh enables them."""
        degrees = {name: degree for name, degree in (("dp", mesh.dp_shard), ("tp", mesh.tp)) if degree > 1}
        if not degrees:
            return
        device_mesh = init_device_mesh("cpu", tuple(degrees.values()), mesh_dim_names=tuple(degrees))
        if mesh.tp_enabled:
            apply_tp(model, device_mesh["tp"], tp_plan(model, self.task.tp_plan))
        if mesh.dp_shard_enabled:
            apply_fsdp(model, device_mesh["dp"])

    def check(self, layout: Layout, config: TrainConfig, model: nn.Module) -> None:
        """The checks ``mlscale train`` makes of this layout before a worker starts (one line each), on
        ``model`` built on the meta device."""
        layout.strategy.check(config, layout.mesh.size)
        layout.strategy.check_planned(config, model, layout.mesh.size, self.task.tp_plan)

    def step(self, layout: Layout, model: nn.Module) -> RankBytes:
        """Rank 0's bytes after one step of ``layout`` of ``model`` (built on the meta device), and its
        activations with checkpointing."""
        config = self.config
        with fake_world(layout.splitting):
            self.split(model, layout.mesh)
            with fake_mode():
                model.to_empty(device="cpu")
                inputs, targets = _fake_batch(self.example, config.step_batch, config.grad_accum)
                activations = self.forward(model, inputs, targets, backward=True)
                optimizer = _stepped(config, model.parameters())
                state = _state_bytes(model.parameters(), optimizer)
                apply_activation_checkpointing(model, self.checkpointing, config.model.ac_every)
                checkpointed = self.forward(model, inputs, targets, backward=False)
        return RankBytes(state["params"], state["grads"], state["optimizer"], activations, checkpointed)

    def forward(self, model: nn.Module, inputs: Tree, targets: Tree, backward: bool,
                saved: SavedActivations | None = None) -> int:
        """What autograd keeps for the backward of one micro-step (``ReplicaStrategy.step`` measures it so)."""
        saved = saved or SavedActivations(model.parameters())
        with _autocast(self.config), eager_mask_paths(), saved:
            loss = self.task.loss_fn(call_model(model, inputs), targets)
        if backward:
            loss.backward()
        return saved.bytes

    # -- pipeline: every stage count of one fake step of the unsplit model --------------------------------
    def pipeline(self, layouts: list[Layout]) -> dict[Layout, list[RankBytes]]:
        """Each pipeline layout's stages: the blocks balanced by parameters, their parameters, gradients,
        optimizer state, and activations of the microbatches in flight."""
        config = self.config
        model = self.build()
        microbatch = config.batch_size // config.pipeline.microbatches
        with fake_mode():
            model.to_empty(device="cpu")  # new parameter objects: the units are found after
            units = _pipeline_units(model)
            inputs, targets = _fake_batch(self.example, config.batch_size, config.pipeline.microbatches)
            assert rows(inputs) == microbatch
            saved = _SavedByUnit(model, units)
            with saved.attributing():
                self.forward(model, inputs, targets, backward=True, saved=saved)
            optimizer = _stepped(config, model.parameters())
            plans = {}
            for layout in layouts:
                stages = _stage_units(units, layout.mesh.pp)
                ranks = []
                for stage, names in enumerate(stages):
                    params = list({id(p): p for name in names for p in units.params[name]}.values())
                    state = _state_bytes(params, optimizer)
                    in_flight = config.pipeline.microbatches if config.pipeline.schedule == "gpipe" else \
                        min(config.pipeline.microbatches, layout.mesh.pp - stage)
                    activations = sum(saved.by_unit.get(name, 0) for name in names) * in_flight
                    ranks.append(RankBytes(state["params"], state["grads"], state["optimizer"], activations, None,
                                           stage))
                plans[layout] = ranks
        return plans


def _stepped(config: TrainConfig, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    """The run's optimizer (``build_optimizer``) after its first step, which creates its state. Plain
    tensors are stepped with the multi-tensor kernels: the same state tensors as the per-tensor loop a CPU
    run uses, in a fraction of the operations (each costs the same on fake tensors whatever its size);
    split (DTensor) ones by the per-tensor loop, which takes a mix of split and whole parameters."""
    params = list(params)
    optimizer = build_optimizer(config, params)
    if not any(isinstance(param, DTensor) for param in params):
        for group in optimizer.param_groups:
            group["foreach"] = True
    optimizer.step()
    return optimizer


def _state_bytes(params: Sequence[torch.Tensor] | Iterator[nn.Parameter], optimizer: torch.optim.Optimizer
                 ) -> dict[str, int]:
    """``state_memory`` of ``params`` and only their optimizer state (a stage holds its own), in bytes."""
    params = list(params)
    seen: set[int] = set()
    state = [value for p in params for value in optimizer.state.get(p, {}).values() if isinstance(value, torch.Tensor)]
    return {"params": storage_bytes(params, seen),
            "grads": storage_bytes((p.grad for p in params if p.grad is not None), seen),
            "optimizer": storage_bytes(state, seen)}


@dataclass
class _Units:
    """The model cut where a pipeline may cut it: ``before`` the blocks, each block, ``after`` them; the
    parameters each holds (a tie in two units in both) and every module's unit."""

    order: list[str]
    params: dict[str, list[nn.Parameter]]
    module_unit: dict[str, str]


def _pipeline_units(model: nn.Module) -> _Units:
    found = block_container(model)
    assert found is not None, "checked before"
    container_name, container = found
    prefix = f"{container_name}." if container_name else ""
    blocks = [name for name, child in container.named_children() if param_count(child)]
    order = ["before", *(f"block {name}" for name in blocks), "after"]
    params: dict[str, list[nn.Parameter]] = {unit: [] for unit in order}
    module_unit: dict[str, str] = {}
    modules = list(model.named_modules(remove_duplicate=False))
    at = [name for name, _ in modules].index(container_name)
    for index, (name, module) in enumerate(modules):
        own = list(module.parameters(recurse=False))
        if name == container_name or not name or container_name.startswith(f"{name}."):
            params["before"].extend(own)  # the container and its ancestors: their own parameters go to stage 0
            continue
        if name.startswith(prefix):  # inside the container: the block it belongs to
            unit = f"block {name[len(prefix):].split('.')[0]}"
            if unit not in params:  # a child without parameters runs where it is called from
                continue
        else:
            unit = "before" if index < at else "after"
        module_unit[name] = unit
        params[unit].extend(own)
    return _Units(order, params, module_unit)


def _stage_units(units: _Units, stages: int) -> list[list[str]]:
    """The units of each stage: the blocks balanced by parameter count (``stages.balance``), what
    comes before them counted with the first block and what comes after with the last."""
    blocks = units.order[1:-1]

    def numel(unit: str) -> int:
        return sum(p.numel() for p in {id(p): p for p in units.params[unit]}.values())

    weights = [numel(unit) for unit in blocks]
    weights[0] += numel("before")
    weights[-1] += numel("after")
    groups, at = [], 0
    for length in balance(weights, stages):
        groups.append(blocks[at:at + length])
        at += length
    groups[0].insert(0, "before")
    groups[-1].append("after")
    return groups


class _SavedByUnit(SavedActivations):
    """``SavedActivations`` that also says which unit saved each tensor: the unit whose module ran last
    (the loss, computed after the model, goes to the last stage with the head)."""

    def __init__(self, model: nn.Module, units: _Units) -> None:
        super().__init__(model.parameters())
        self.model, self.units = model, units
        self.current = "before"
        self.by_unit: dict[str, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        before = self.bytes
        packed = super()._pack(tensor)
        if self.bytes != before:
            self.by_unit[self.current] = self.by_unit.get(self.current, 0) + self.bytes - before
        return packed

    @contextlib.contextmanager
    def attributing(self) -> Iterator[None]:
        handles = []
        for name, module in self.model.named_modules(remove_duplicate=False):
            unit = self.units.module_unit.get(name)
            if unit is not None:
                handles.append(module.register_forward_pre_hook(self._entering(unit)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _entering(self, unit: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.current = unit
        return hook


# -- the plan ----------------------------------------------------------------------------------------------
def _config(base: dict[str, Any], strategy: type[Strategy], options: dict[str, Any]) -> TrainConfig:
    """``base`` validated with a layout's ``options`` (its ``strategy``'s options only: another's are
    dropped, not refused)."""
    values = {key: value for key, value in base.items() if key not in strategy.plan_ignores}
    return validated(merged(values, options))


def plan_memory(options: dict[str, Any], config_file: str | None = None, default_workers: int = 1) -> MemoryPlan:
    """Every layout of ``options`` (``mlscale train``'s option names: task, task_options, workers,
    batch_size, dtype, precision, optimizer, activation_checkpointing, memory_limit_mb, ...; ``strategy``:
    the strategies to plan, comma-separated, default all; ``workers`` when neither gives it:
    ``default_workers``) predicted. A bad task or option is a
    ``UsageError`` (one line); a layout the model cannot take is listed with why."""
    if dist.is_available() and dist.is_initialized():
        raise UsageError("mlscale plan runs outside a distributed job (it makes process groups of its own)")
    start = time.perf_counter()
    base = {**(flatten(read_config_file(config_file)) if config_file else {}),
            **{key: value for key, value in options.items() if value is not None}}
    strategies = _strategies(str(base.pop("strategy", ",".join(strategy.name for strategy in planned()))))
    base.pop("run_dir", None)
    base.setdefault("workers", default_workers)
    config = _config(base, STRATEGIES[TrainConfig.model_fields["strategy"].default], {})
    # The pipeline's options (the stage pass's and the report's), validated once, on the smallest staged layout.
    staged = [layout for layout in candidate_layouts(2, strategies) if layout.mesh.pp_enabled]
    pipeline_config = _config(base, staged[0].strategy, staged[0].options()) if staged else config
    config = config.model_copy(update={"pipeline": pipeline_config.pipeline})
    task = make_task(config.task, config.task_options)
    checkpointing = config.model.activation_checkpointing
    checkpointing = "full" if checkpointing == "none" else checkpointing
    planner = _Planner(task, config, checkpointing)
    plans: list[LayoutPlan] = []
    pipelines: list[Layout] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on fake tensors and FSDP's hooks, not the user's
        for layout in candidate_layouts(config.workers, strategies):
            plan = LayoutPlan(layout)
            plans.append(plan)
            try:
                layout_config = _config(base, layout.strategy, layout.options())
                model = planner.build()
                planner.check(layout, layout_config, model)
                if layout.mesh.pp_enabled:
                    pipelines.append(layout)
                    continue
                planner.config = layout_config
                plan.ranks = [planner.step(layout, model)]
            except UsageError as exc:
                plan.refused = str(exc)
            except Exception as exc:  # a model fake tensors cannot run: said, the other layouts go on
                plan.refused = f"not estimated: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if pipelines:
            planner.config = pipeline_config
            try:
                stages = planner.pipeline(pipelines)
            except Exception as exc:
                stages = {}
                for plan in plans:
                    if plan.layout in pipelines:
                        plan.refused = f"not estimated: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            for plan in plans:
                if plan.layout in stages:
                    plan.ranks = stages[plan.layout]
    return MemoryPlan(config.task, config, checkpointing, plans, time.perf_counter() - start)
