"""How a plain model is split over devices: FSDP2 units, tensor-parallel plans and pipeline stages.

Model code never imports this; these functions take a finished plain model and change it from
outside (torchtitan's separation of model and ``parallelize``). What they know about a model is its
structure: the blocks in containers (``nn.ModuleDict`` / ``nn.ModuleList`` / ``nn.Sequential``), the
names of a transformer block's projections, and for pipeline stages which top-level parts come
before and after the blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from mlscale.errors import UsageError

CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def param_count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


# -- FSDP2 ----------------------------------------------------------------------------------------------
def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, innermost first: every block of a container (a
    transformer's layers, a Sequential's layers). The root takes what is left (embeddings, head)."""
    units: list[nn.Module] = []
    for module in reversed(list(model.modules())):  # every module comes after the modules inside it
        if isinstance(module, CONTAINERS):
            units.extend(child for child in module.children() if param_count(child))
    return units


def apply_fsdp(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters outside any unit, and the root's communication schedule
    return model


# -- tensor parallelism (Megatron-style) ---------------------------------------------------------------
_COLUMN = ("wq", "wk", "wv", "w1")  # split by output features: each rank computes some heads / MLP columns
_ROW = ("wo", "w2")  # split by input features: partial sums, all-reduced into the replicated output


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Which linear layers split how: in each transformer block, the attention's q/k/v projections and
    the MLP's first layer by columns, the attention output and the MLP's second layer by rows."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in _COLUMN + _ROW:
            plan[name] = "colwise" if leaf in _COLUMN else "rowwise"
    if not plan:
        raise UsageError("--strategy tp splits transformer blocks (attention wq/wk/wv/wo and MLP w1/w2 linear "
                         "layers, as in --task tinylm); this model has none. Use --strategy fsdp to shard it")
    return plan


def check_tp_divides(model: nn.Module, ways: int) -> None:
    heads = {m.wq.out_features // m.head_dim for m in model.modules() if hasattr(m, "head_dim") and hasattr(m, "wq")}
    for count in heads:
        if count % ways:
            raise UsageError(f"bad value workers={ways}: tensor parallelism splits the {count} attention heads "
                             f"over the ranks, so their number must divide the heads")


def apply_tp(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in tp_plan(model).items()}
    return parallelize_module(model, mesh, plan)


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
