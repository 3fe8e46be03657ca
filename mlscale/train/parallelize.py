"""How a plain model is split over devices: FSDP2 units and tensor-parallel plans (pipeline stages are
``mlscale.train.stages``).

Model code never imports this; these functions take a finished plain model and change it from
outside (torchtitan's separation of model and ``parallelize``). What they know about a model is its
structure: the blocks in containers (``nn.ModuleDict`` / ``nn.ModuleList`` / ``nn.Sequential``), the
names of a transformer block's projections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.utils.checkpoint
from torch import nn

from mlscale.errors import UsageError
from mlscale.weights import tied_groups

CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def param_count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


# -- the blocks ------------------------------------------------------------------------------------------
# The model's repeated blocks are the container (ModuleList/ModuleDict/Sequential) whose children all have
# one type, found anywhere in the model (transformer.h, model.layers, tinylm's layers): blocks that repeat
# first, then the largest by parameters. A Sequential of layers of different kinds is its own container.
@dataclass(frozen=True)
class BlockContainer:
    """The model's repeated blocks: the container's name ("" for the model itself) and its children's."""

    name: str
    children: tuple[str, ...]

    def fqn(self, child: str) -> str:
        return f"{self.name}.{child}" if self.name else child


def find_blocks(model: nn.Module) -> BlockContainer | None:
    """The container of the model's repeated blocks (module docstring), or None when it has none."""
    best: tuple[bool, int, int] | None = None
    found: BlockContainer | None = None
    for name, module in model.named_modules():
        children = [child for child in module._modules.values() if child is not None]
        if not isinstance(module, CONTAINERS) or not children or len({type(child) for child in children}) != 1:
            continue
        # blocks that repeat first (one block alone is found only to say it cannot be split), then the largest
        size = (len(children) > 1, param_count(module), len(children))
        if best is None or size > best:
            best, found = size, BlockContainer(name, tuple(k for k, v in module._modules.items() if v is not None))
    if found is None and isinstance(model, nn.Sequential) and len(model._modules) >= 2:
        found = BlockContainer("", tuple(model._modules))  # layers of different kinds, run in order
    return found


def block_container(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The container of the model's repeated blocks and its name ("" for the model itself); ``None``
    without two or more blocks."""
    found = find_blocks(model)
    if found is None or len(found.children) < 2:
        return None
    return found.name, model.get_submodule(found.name) if found.name else model


# -- activation checkpointing ---------------------------------------------------------------------------
def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> list[str]:
    """Recompute the activations of the model's blocks in the backward pass instead of keeping them
    (``full``: every block; ``selective``: every ``every``-th). The block's ``forward`` is wrapped in place
    (non-reentrant ``torch.utils.checkpoint``), so parameter names, and checkpoints, stay the model's own.
    Returns the names of the blocks it applies to."""
    if mode == "none":
        return []
    found = block_container(model)
    if found is None:
        raise UsageError(f"bad value activation-checkpointing={mode!r}: {type(model).__name__} has no repeated "
                         "blocks (a ModuleList, ModuleDict or Sequential of same-typed modules) to recompute")
    name, container = found
    chosen = []
    for index, (child_name, block) in enumerate(container.named_children()):
        if mode == "full" or index % every == every - 1:
            _checkpoint_forward(block)
            chosen.append(f"{name}.{child_name}" if name else child_name)
    return chosen


def _checkpoint_forward(block: nn.Module) -> None:
    forward = block.forward

    def recomputed(*args: object, **kwargs: object) -> object:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed  # type: ignore[method-assign]


# -- FSDP2 ----------------------------------------------------------------------------------------------
def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, innermost first: every block of a container (a
    transformer's layers, a Sequential's layers). The root takes what is left (embeddings, head)."""
    units: list[nn.Module] = []
    for module in reversed(list(model.modules())):  # every module comes after the modules inside it
        if isinstance(module, CONTAINERS):
            units.extend(child for child in module.children() if param_count(child))
    return units


def apply_fsdp(model: nn.Module, mesh: object, offload: bool = False) -> nn.Module:
    """FSDP2 on every unit, then the root. ``offload``: the sharded parameters, gradients and optimizer state
    live in (pinned) host memory and each unit is copied to the device just before it runs (FSDP2's
    ``CPUOffloadPolicy``): a GPU then holds only the blocks in flight and the activations."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    scalars = unshardable(model)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, offload_policy=policy, ignored_params=scalars)
    fully_shard(model, mesh=mesh, offload_policy=policy, ignored_params=scalars)  # the rest, and the root's schedule
    return model


def unshardable(model: nn.Module) -> set[nn.Parameter]:
    """Scalar (0-dimensional) parameters, such as a learned temperature: FSDP2 shards along the first
    dimension and refuses them, so they stay whole on every rank and their gradients are averaged apart."""
    return {param for param in model.parameters() if param.dim() == 0}


# -- tensor parallelism (Megatron-style) ---------------------------------------------------------------
# A plan maps module-name patterns (``*`` matches one name, e.g. a block's index) to how the module splits,
# in the words of Hugging Face's ``_tp_plan`` and torchtitan. Column-wise: split by output features (each
# rank computes some heads / MLP columns); row-wise: split by input features (partial sums all-reduced into
# the replicated output). The ``*_gather_output``/``*_rep`` forms all-gather a column split's output again
# (an LM head whose loss wants every logit); ``embedding_rowwise`` splits an embedding's vocabulary.
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "embedding_rowwise")

# tinylm's plan (and any model written like it): attention q/k/v and the MLP's first layer by columns,
# the attention output and the MLP's second layer by rows.
BUILTIN_TP_PLAN = {
    "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w2": "rowwise",
}


@dataclass(frozen=True)
class TPPlan:
    """Which module splits how (by full name), and where the plan came from (said at the start)."""

    modules: dict[str, str]
    source: str
    skipped: tuple[str, ...] = ()  # modules of the plan left whole, with why

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for style in self.modules.values():
            kinds[style] = kinds.get(style, 0) + 1
        counts = ", ".join(f"{count} {style}" for style, count in kinds.items())
        left = f"; left whole: {'; '.join(self.skipped)}" if self.skipped else ""
        return f"tensor-parallel plan from {self.source}: {len(self.modules)} modules ({counts}){left}"


def declared_tp_plan(model: nn.Module, task_plan: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """The plan's patterns and their source: the task's ``tp_plan``, else the model's own (Hugging Face:
    ``_tp_plan``, or its config's ``base_model_tp_plan`` under the base model's prefix), else those of the
    models nested in it (a Hugging Face model wrapped in the user's module, with a head or a loss around
    it: each plan is relative to its own model, so it is prefixed with that model's path), else the
    built-in one of tinylm-shaped models."""
    if task_plan:
        return dict(task_plan), "the task (Task.tp_plan)"
    own = _declared_by(model, "")
    if own is not None:
        return own
    nested: dict[str, str] = {}
    sources: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{holder}.") for holder, _ in sources):
            continue  # the model itself, or inside a model whose plan is taken already
        declared = _declared_by(module, f"{name}.")
        if declared is not None:
            nested.update(declared[0])
            sources.append((name, declared[1]))
    if nested:
        return nested, "; ".join(f"{source} at {name}" for name, source in sources)
    return dict(BUILTIN_TP_PLAN), "mlscale's built-in plan for tinylm-shaped blocks"


def _declared_by(model: nn.Module, prefix: str) -> tuple[dict[str, str], str] | None:
    """The plan ``model`` declares itself, its patterns under ``prefix`` (its path in the whole model)."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict) and own:
        return {prefix + pattern: style for pattern, style in own.items()}, \
            f"the model ({type(model).__name__}._tp_plan)"
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        inner = getattr(model, "base_model_prefix", "")
        inner = f"{inner}." if inner and hasattr(model, inner) else ""
        return {prefix + inner + pattern: style for pattern, style in base.items()}, \
            f"the model's config ({type(config).__name__}.base_model_tp_plan)"
    return None


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in text.split(".")))


def _tied(model: nn.Module) -> set[str]:
    """Names of modules holding a parameter that another module holds too (a tied embedding and head)."""
    return {name.rpartition(".")[0] for group in tied_groups(model) for name in group}


def tp_plan(model: nn.Module, task_plan: dict[str, str] | None = None) -> TPPlan:
    """The modules of ``model`` that tensor parallelism splits, and how; refuses (``UsageError``) a plan
    that names an unknown style or matches no module."""
    patterns, source = declared_tp_plan(model, task_plan)
    for pattern, style in patterns.items():
        if style not in TP_STYLES:
            raise UsageError(f"bad tensor-parallel plan from {source}: {pattern!r} asks for {style!r}, which mlscale "
                             f"does not apply (it applies: {', '.join(TP_STYLES)})")
    compiled = [(_pattern(pattern), style) for pattern, style in patterns.items()]
    tied, modules, skipped = _tied(model), {}, []
    for name, module in model.named_modules():
        style = next((style for regex, style in compiled if regex.fullmatch(name)), None)
        if style is None:
            continue
        wanted = nn.Embedding if style == "embedding_rowwise" else nn.Linear
        if not isinstance(module, wanted):
            raise UsageError(f"bad tensor-parallel plan from {source}: {name!r} is a {type(module).__name__}; "
                             f"{style!r} splits an nn.{wanted.__name__}")
        if name in tied:  # splitting one of two holders would untie them; a tie is kept whole
            skipped.append(f"{name} (its weight is tied to another module's)")
            continue
        modules[name] = style
    if not modules:
        raise UsageError(f"bad tensor-parallel plan from {source}: its patterns ({', '.join(list(patterns)[:4])}"
                         f"{', ...' if len(patterns) > 4 else ''}) name no module of {type(model).__name__}; give "
                         "the task a tp_plan of module-name patterns, or use --strategy fsdp to shard it")
    return TPPlan(modules, source, tuple(skipped))


def _heads(module: nn.Module, parent: nn.Module | None) -> int | None:
    """How many attention heads a column split of ``module`` cuts through, when its attention says its head
    size (``head_dim``, as tinylm's and Hugging Face's attention modules do)."""
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and isinstance(module, nn.Linear):
        return module.out_features // head_dim
    return None


def check_tp_divides(model: nn.Module, plan: TPPlan, ways: int) -> None:
    """Refuse a degree that would cut an attention head, or a split dimension, unevenly."""
    for name, style in plan.modules.items():
        module = model.get_submodule(name)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        heads = _heads(module, parent) if style.startswith("colwise") else None
        if heads is not None and heads % ways:
            raise UsageError(f"bad value tp={ways}: tensor parallelism splits the {heads} attention heads of {name} "
                             "over the ranks, so their number must divide the heads")
        if isinstance(module, nn.Linear):
            size = module.out_features if style.startswith("colwise") else module.in_features
        else:
            size = module.num_embeddings
        if size % ways:
            raise UsageError(f"bad value tp={ways}: {name} ({style}) splits {size} features over the ranks; "
                             f"{ways} must divide them")


def apply_tp(model: nn.Module, mesh: object, plan: TPPlan) -> nn.Module:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "rowwise_rep": RowwiseParallel,
              "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    return parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.modules.items()})
