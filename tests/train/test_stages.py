"""Pipeline stages, in one process: where a model's blocks are found and split, and what the traced
stages hold (the unsplit model's names, its buffers, a tied weight on every stage that uses it) and
return (the model's own output structure)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mlscale.errors import UsageError
from mlscale.tasks import make_task
from mlscale.train.stages import alias_groups, balance, find_blocks, plan_stages, retie, split_model
from mlscale.train.state import assemble

GPT2 = "tests.user_models:gpt2"


def build(task_name: str, **options: object) -> tuple[nn.Module, torch.Tensor, object]:
    task = make_task(task_name, options)
    torch.manual_seed(0)
    return task.build_model().double(), task.example_inputs(2, torch.float64), task


def test_balance_minimises_the_largest_stage():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # sums 15, 13, 17: no split has a max below 17


@pytest.mark.parametrize(("task_name", "options", "container"), [
    ("tinylm", {"layers": 4, "samples": 16}, "layers"),
    (GPT2, {}, "transformer.h"),
    ("tests.user_models:llama", {}, "model.layers"),
    ("tests.user_models:cnn", {}, "blocks"),
])
def test_the_blocks_are_found_wherever_the_model_keeps_them(task_name, options, container):
    with torch.device("meta"):
        model = make_task(task_name, options).build_model()
    blocks = find_blocks(model)
    assert blocks is not None and blocks.name == container


def test_a_sequential_of_mixed_layers_is_its_own_container_and_a_model_without_blocks_is_refused():
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))).name == ""
    loose = nn.Module()
    loose.a, loose.b = nn.Linear(2, 2), nn.Conv1d(1, 1, 1)
    with pytest.raises(UsageError, match=r"no repeated blocks.*--split-points"):
        plan_stages(loose, 2)


def test_stages_start_at_balanced_blocks_with_the_embeddings_counted_in_the_first():
    model, _, _ = build("tinylm", layers=4, samples=16)
    assert plan_stages(model, 2).starts == ("layers.2",)
    gpt2, _, _ = build(GPT2, layers=4)
    assert plan_stages(gpt2, 2).starts == ("transformer.h.2",)  # the tied head is counted with the last stage


@pytest.mark.parametrize(("points", "stages", "message"), [
    (["transformer.h.9"], 2, "the model has no module 'transformer.h.9' (its blocks: transformer.h.0"),
    (["transformer.h.1", "transformer.h.2"], 2, "2 name(s) for --stages 2"),
    (["transformer.h.2", "transformer.h.1", "transformer.h.3"], 4, "'transformer.h.1' does not come after"),
])
def test_split_points_are_checked(points, stages, message):
    with torch.device("meta"):
        model = make_task(GPT2, {}).build_model()
    with pytest.raises(UsageError, match=re.escape(message)):
        plan_stages(model, stages, points)


def test_gpt2_stages_keep_its_names_and_its_tie_on_both_ends():
    model, sample, task = build(GPT2, layers=4)
    expected = set(model.state_dict())
    split = split_model(model, plan_stages(model, 2), sample)
    first, last = split.stage_module(0), split.stage_module(1)
    assert set(first.state_dict()) | set(last.state_dict()) == expected
    # pipeline() copies the tied weight into both stages; each holds its copy under both names, as one tensor
    assert first.get_parameter("lm_head.weight") is first.get_parameter("transformer.wte.weight")
    assert last.get_parameter("lm_head.weight") is last.get_parameter("transformer.wte.weight")
    assert [(tie.names, tie.stages) for tie in split.ties] == [(("transformer.wte.weight", "lm_head.weight"), (0, 1))]
    assert "transformer.h.2.ln_1.weight" in last.state_dict()
    assert "transformer.h.2.ln_1.weight" not in first.state_dict()
    assert "tied across stages 0 and 1, kept in step: transformer.wte.weight = lm_head.weight" in split.describe()

    # the last stage's output, rebuilt, is the unsplit model's ModelOutput
    torch.manual_seed(0)
    plain = task.build_model().double()
    hidden = first(sample)
    output = split.rebuild_output(last(*hidden))
    assert type(output) is type(plain(sample)) and torch.allclose(output.logits, plain(sample).logits, atol=1e-12)

    # assembled again from the stages' state, the head is the embedding (one parameter)
    state = {**first.state_dict(), **last.state_dict()}
    assembled = retie(assemble(lambda: task.build_model().double(), state), split.aliases)
    assert assembled.lm_head.weight is assembled.transformer.wte.weight
    assert [names for names in alias_groups(assembled) if len(names) > 1] == split.aliases


def test_cnn_stages_keep_buffers_unused_ones_and_the_free_parameter_and_return_its_dict():
    model, sample, task = build("tests.user_models:cnn")
    expected = set(model.state_dict())  # version (persistent, never read); pixel_mean is not persistent
    split = split_model(model, plan_stages(model, 3), sample)
    stages = [split.stage_module(index) for index in range(3)]
    assert set().union(*(set(stage.state_dict()) for stage in stages)) == expected
    assert "version" in stages[0].state_dict()  # read by no forward: the first stage keeps it
    assert "pixel_mean" in dict(stages[0].named_buffers()) and "pixel_mean" not in stages[0].state_dict()
    assert "temperature" in stages[2].state_dict() and not split.ties
    output = split.rebuild_output(stages[2](stages[1](stages[0](sample))))
    plain = task.build_model().double()
    plain.load_state_dict(model.state_dict())
    reference = plain(sample)
    assert list(output) == ["logits", "features_norm"]
    assert all(torch.allclose(output[key], reference[key], atol=1e-12) for key in reference)


def test_a_model_torch_cannot_export_is_refused_in_one_line():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
                if x.sum() > 0:  # control flow on a value: torch.export cannot trace it
                    x = -x
            return x

    model = DataDependent()
    with pytest.raises(UsageError, match=r"cannot trace this model with torch\.export") as caught:
        split_model(model, plan_stages(model, 2), torch.randn(2, 4))
    assert "\n" not in str(caught.value) and "--strategy fsdp" in str(caught.value)


def test_a_value_read_past_the_next_stage_is_handed_on_by_the_stages_between():
    # Llama's rotary position values are made before the first block and read by every block: on four
    # stages each stage in between takes them from its neighbour and returns them for the next one.
    import operator

    task = make_task("tests.user_models:llama", {"layers": 4})
    sample = task.example_inputs(2, torch.float64)
    torch.manual_seed(0)
    model = task.build_model().double()
    expected = model(sample).logits
    split = split_model(model, plan_stages(model, 4), sample)
    graph = split.pipe.split_gm.graph
    stages = [node for node in graph.nodes if node.op == "call_module"]
    for position, stage in enumerate(stages):
        for value in stage.all_input_nodes:
            while value.op == "call_function" and value.target is operator.getitem:
                value = value.args[0]
            assert value.op == "placeholder" or value is stages[position - 1], f"{stage.name} reads {value.name}"
    [logits] = [leaf for leaf in torch.utils._pytree.tree_leaves(split.pipe(sample))  # the stages in turn, here
                if isinstance(leaf, torch.Tensor) and leaf.shape == expected.shape]
    assert (logits - expected).abs().max().item() <= 1e-12
