"""The plans that split a plain model: FSDP units innermost first, balanced pipeline stages that keep
the unsplit model's names, and the tensor-parallel plan of a transformer block."""

import pytest
from torch import nn

from mlscale.errors import UsageError
from mlscale.tasks import make_task
from mlscale.train.parallelize import balance, fsdp_units, keep_stage, plan_stages, tp_plan


def test_fsdp_units_come_after_the_units_inside_them():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    block = nn.Module()
    block.proj, block.downsample = nn.Linear(2, 2), inner
    model = nn.Sequential(block, nn.Linear(2, 2))
    units = fsdp_units(model)
    assert units.index(block) > max(units.index(child) for child in inner)  # fully_shard wraps inner ones first


def test_balance_minimises_the_largest_stage():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # sums 15, 13, 17: no split has a max below 17


def test_a_stage_keeps_the_unsplit_names_and_only_its_parts():
    model = make_task("tinylm", {"layers": 4, "samples": 16}).build_model()
    names = {name for name, _ in model.named_parameters()}
    plan = plan_stages(model, 2)
    assert plan.blocks == [["0", "1"], ["2", "3"]]
    first = {name for name, _ in keep_stage(make_task("tinylm", {"layers": 4, "samples": 16}).build_model(), plan,
                                             0).named_parameters()}
    last = {name for name, _ in keep_stage(model, plan, 1).named_parameters()}
    assert first | last == names and not first & last
    assert "tok_embeddings.weight" in first and "output.weight" in last and "layers.2.attention.wq.weight" in last


def test_the_tp_plan_splits_attention_and_mlp_and_refuses_other_models():
    plan = tp_plan(make_task("tinylm", {"layers": 1, "samples": 16}).build_model())
    assert plan == {"layers.0.attention.wq": "colwise", "layers.0.attention.wk": "colwise",
                    "layers.0.attention.wv": "colwise", "layers.0.attention.wo": "rowwise",
                    "layers.0.feed_forward.w1": "colwise", "layers.0.feed_forward.w2": "rowwise"}
    with pytest.raises(UsageError, match="this model has none"):
        tp_plan(nn.Sequential(nn.Linear(2, 2)))
