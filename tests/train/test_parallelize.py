"""The plans that split a plain model: FSDP units innermost first, tensor-parallel plans (built in, the
model's own, the task's) and the blocks that activation checkpointing recomputes (pipeline stages:
tests/train/test_stages.py)."""

import pytest
from torch import nn

from mlscale.errors import UsageError
from mlscale.tasks import make_task
from mlscale.train.parallelize import (
    apply_activation_checkpointing,
    block_container,
    check_tp_divides,
    fsdp_units,
    tp_plan,
)


def test_fsdp_units_come_after_the_units_inside_them():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    block = nn.Module()
    block.proj, block.downsample = nn.Linear(2, 2), inner
    model = nn.Sequential(block, nn.Linear(2, 2))
    units = fsdp_units(model)
    assert units.index(block) > max(units.index(child) for child in inner)  # fully_shard wraps inner ones first


def test_the_built_in_tp_plan_splits_attention_and_mlp_and_a_model_without_blocks_is_refused():
    plan = tp_plan(make_task("tinylm", {"layers": 1, "samples": 16}).build_model())
    assert plan.modules == {"layers.0.attention.wq": "colwise", "layers.0.attention.wk": "colwise",
                            "layers.0.attention.wv": "colwise", "layers.0.attention.wo": "rowwise",
                            "layers.0.feed_forward.w1": "colwise", "layers.0.feed_forward.w2": "rowwise"}
    with pytest.raises(UsageError, match="name no module of Sequential"):
        tp_plan(nn.Sequential(nn.Linear(2, 2)))


def _llama(**options):
    return make_task("tests.user_models:llama", {"layers": 2, **options}).build_model()


def test_a_hugging_face_model_brings_its_own_plan_and_the_task_s_plan_comes_first():
    model = _llama()
    plan = tp_plan(model)
    assert "LlamaForCausalLM._tp_plan" in plan.source
    assert plan.modules["model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan.modules["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan.modules["lm_head"] == "colwise_gather_output"
    own = tp_plan(model, {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"})
    assert own.source == "the task (Task.tp_plan)" and set(own.modules.values()) == {"colwise", "rowwise"}
    assert len(own.modules) == 4


@pytest.mark.parametrize(("plan", "message"), [
    ({"blocks.*.attn": "colwise"}, "name no module of LlamaForCausalLM"),
    ({"model.layers.*.self_attn.q_proj": "diagonal"}, "asks for 'diagonal', which mlscale does not apply"),
    ({"model.layers.*.self_attn": "colwise"}, "'model.layers.0.self_attn' is a LlamaAttention"),
])
def test_a_plan_that_cannot_be_applied_is_refused_in_one_line(plan, message):
    with pytest.raises(UsageError, match=message):
        tp_plan(_llama(), plan)


def test_a_degree_that_cuts_a_head_or_a_split_dimension_is_refused():
    model = _llama(heads=4, kv_heads=2)
    plan = tp_plan(model)
    check_tp_divides(model, plan, 2)
    with pytest.raises(UsageError, match="tp=4: tensor parallelism splits the 2 attention heads"):
        check_tp_divides(model, plan, 4)  # 2 key/value heads cannot go to 4 ranks


def test_a_tied_embedding_and_head_are_left_whole():
    model = make_task("tests.user_models:llama", {"layers": 2}).build_model()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as most language models are
    plan = tp_plan(model)
    assert "lm_head" not in plan.modules and "model.embed_tokens" not in plan.modules
    assert any("lm_head" in why for why in plan.skipped)


def test_the_repeated_blocks_are_found_wherever_the_model_keeps_them():
    gpt2 = make_task("tests.user_models:gpt2", {"layers": 3}).build_model()
    assert block_container(gpt2)[0] == "transformer.h"
    assert block_container(_llama())[0] == "model.layers"
    assert block_container(make_task("tinylm", {"layers": 2, "samples": 16}).build_model())[0] == "layers"
    assert block_container(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))[0] == ""
    assert block_container(nn.Linear(2, 2)) is None


def test_activation_checkpointing_recomputes_the_chosen_blocks_and_keeps_the_names():
    model = make_task("tinylm", {"layers": 4, "samples": 16}).build_model()
    names = [name for name, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, "selective", every=2) == ["layers.1", "layers.3"]
    assert [name for name, _ in model.named_parameters()] == names
    full = make_task("tinylm", {"layers": 4, "samples": 16}).build_model()
    assert apply_activation_checkpointing(full, "full") == [f"layers.{i}" for i in range(4)]
    with pytest.raises(UsageError, match="has no repeated blocks"):
        apply_activation_checkpointing(nn.Linear(2, 2), "full")
