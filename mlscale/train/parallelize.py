"""How a plain model is split over devices: FSDP2 units and tensor-parallel plans (pipeline stages are
``mlscale.train.stages``).

Model code never imports this; these functions take a finished plain model and change it from
outside (torchtitan's separation of model and ``parallelize``). What they know about a model is its
structure: the blocks in containers (``nn.ModuleDict`` / ``nn.ModuleList`` / ``nn.Sequential``), the
names of a transformer block's projections.
"""

from __future__ import annotations

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
