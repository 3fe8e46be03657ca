"""The plans that split a plain model: FSDP units innermost first and the tensor-parallel plan of a
transformer block (pipeline stages: tests/train/test_stages.py)."""

import pytest
from torch import nn

from mlscale.errors import UsageError
from mlscale.tasks import make_task
from mlscale.train.parallelize import fsdp_units, tp_plan


def test_fsdp_units_come_after_the_units_inside_them():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    block = nn.Module()
    block.proj, block.downsample = nn.Linear(2, 2), inner
    model = nn.Sequential(block, nn.Linear(2, 2))
    units = fsdp_units(model)
    assert units.index(block) > max(units.index(child) for child in inner)  # fully_shard wraps inner ones first


def test_the_tp_plan_splits_attention_and_mlp_and_refuses_other_models():
    plan = tp_plan(make_task("tinylm", {"layers": 1, "samples": 16}).build_model())
    assert plan == {"layers.0.attention.wq": "colwise", "layers.0.attention.wk": "colwise",
                    "layers.0.attention.wv": "colwise", "layers.0.attention.wo": "rowwise",
                    "layers.0.feed_forward.w1": "colwise", "layers.0.feed_forward.w2": "rowwise"}
    with pytest.raises(UsageError, match="this model has none"):
        tp_plan(nn.Sequential(nn.Linear(2, 2)))
