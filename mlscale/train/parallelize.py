"""How a plain model is split over devices: FSDP2 units, tensor-parallel plans and pipeline stages.

Model code never imports this; these functions take a finished plain model and change it from
outside (torchtitan's separation of model and ``parallelize``). What they know about a model is its
structure: the blocks in containers (``nn.ModuleDict`` / ``nn.ModuleList`` / ``nn.Sequential``), the
names of a transformer block's projections, and for pipeline stages which top-level parts come
before and after the blocks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from mlscale.errors import UsageError
from mlscale.weights import tied_groups

CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def param_count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def block_container(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's repeated blocks: the container (``ModuleList``/``ModuleDict``/``Sequential``) with the
    most children of one type holding parameters, found anywhere in the model (``transformer.h``,
    ``model.layers``, tinylm's ``layers``, a Sequential model itself); ``None`` without one."""
    best: tuple[int, int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, CONTAINERS):
            continue
        children = [child for child in module.children() if param_count(child)]
        if len(children) < 2 or len({type(child) for child in children}) != 1:
            continue
        key = (len(children), param_count(module))
        if best is None or key > best[:2]:
            best = (*key, name, module)
    return None if best is None else (best[2], best[3])


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
    import torch.utils.checkpoint

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
    ``_tp_plan``, or its config's ``base_model_tp_plan`` under the base model's prefix), else the built-in
    one of tinylm-shaped models."""
    if task_plan:
        return dict(task_plan), "the task (Task.tp_plan)"
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict) and own:
        return dict(own), f"the model ({type(model).__name__}._tp_plan)"
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        return {prefix + pattern: style for pattern, style in base.items()}, \
            f"the model's config ({type(config).__name__}.base_model_tp_plan)"
    return dict(BUILTIN_TP_PLAN), "mlscale's built-in plan for tinylm-shaped blocks"


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


# -- pipeline stages --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePlan:
    """Which blocks of the model each stage holds; stage 0 also the parts before them, the last stage
    the parts after them."""

    blocks: list[list[str]]  # names of the container's children, per stage
    container: str  # "" for a Sequential model itself, else the attribute holding the blocks
    before: tuple[str, ...]
    after: tuple[str, ...]
    params: list[int]

    def describe(self) -> str:
        def span(names: list[str]) -> str:
            prefix = f"{self.container}." if self.container else ""
            return prefix + (names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}")

        parts = []
        for stage, names in enumerate(self.blocks):
            pieces = [*(self.before if stage == 0 else ()), span(names), *(self.after if stage == len(self.blocks)
                                                                            - 1 else ())]
            parts.append(f"stage {stage}: {', '.join(pieces)} ({self.params[stage]:,} parameters)")
        return "; ".join(parts)


def _structure(model: nn.Module) -> tuple[str, nn.Module, tuple[str, ...], tuple[str, ...]]:
    """(container name, container, parts before, parts after): a Sequential is its own container; a
    model with a ``layers`` container has the children registered before it first, the rest after."""
    if isinstance(model, nn.Sequential):
        return "", model, (), ()
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        names = list(model._modules)
        at = names.index("layers")
        return "layers", layers, tuple(names[:at]), tuple(names[at + 1:])
    raise UsageError("--strategy pipeline splits an nn.Sequential model or one whose blocks are in a `layers` "
                     "container (as --task tinylm); this model is neither. Use --strategy fsdp to shard it")


def balance(weights: Sequence[int], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` contiguous non-empty runs with the smallest largest sum (exact,
    by dynamic programming); returns the run lengths."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for end in range(k, n + 1):
            for start in range(k - 1, end):
                cost = max(best[k - 1][start], prefix[end] - prefix[start])
                if cost < best[k][end]:
                    best[k][end], cut[k][end] = cost, start
    lengths, end = [], n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        lengths.append(end - start)
        end = start
    return lengths[::-1]


def plan_stages(model: nn.Module, stages: int) -> StagePlan:
    """Split the blocks into ``stages`` contiguous groups balanced by parameter count (the parts before
    and after the blocks counted with the first and last stage)."""
    container_name, container, before, after = _structure(model)
    names = list(container._modules)
    if len(names) < stages:
        raise UsageError(f"bad value stages={stages}: the model has only {len(names)} block(s) to split")
    weights = [param_count(container._modules[name]) for name in names]
    weights[0] += sum(param_count(getattr(model, part)) for part in before)
    weights[-1] += sum(param_count(getattr(model, part)) for part in after)
    groups, at = [], 0
    for length in balance(weights, stages):
        groups.append(names[at:at + length])
        at += length
    params = [sum(weights[names.index(n)] for n in group) for group in groups]
    return StagePlan(groups, container_name, before, after, params)


def keep_stage(model: nn.Module, plan: StagePlan, stage: int) -> nn.Module:
    """``model`` with every other stage's parts removed; the names of what is left are unchanged (so
    checkpoints keep the unsplit model's names)."""
    container = getattr(model, plan.container) if plan.container else model
    keep = set(plan.blocks[stage])
    for name in list(container._modules):
        if name not in keep:
            del container._modules[name]  # not `del container[i]`: a Sequential would renumber the rest
    if stage != 0:
        for part in plan.before:
            setattr(model, part, None)
    if stage != len(plan.blocks) - 1:
        for part in plan.after:
            setattr(model, part, None)
    return model
