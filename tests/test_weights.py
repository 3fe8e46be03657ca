"""A model's final weights are one safetensors file that plain ``load_state_dict(strict=True)`` takes,
tied weights included (GPT-2's head is its token embedding), and mlscale's own loader keeps the tie."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from mlscale.tasks import make_task
from mlscale.weights import TIED_KEY, WeightsError, load_weights, save_weights, tied_groups
from tests.helpers import final_weights, max_abs_diff, run_cli
from tests.user_models import SmallCNN

# Trained runs of Hugging Face models built by the first test that needs them: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)

GPT2 = "tests.user_models:gpt2"
TIE = ["transformer.wte.weight", "lm_head.weight"]


def _gpt2() -> nn.Module:
    return make_task(GPT2).build_model()


def test_a_tied_model_is_written_under_every_name_and_the_tie_is_recorded(tmp_path):
    model = _gpt2()
    assert tied_groups(model) == [TIE]
    path = save_weights(model, tmp_path / "model.safetensors", {"task": GPT2})
    with safe_open(str(path), "pt") as file:
        assert json.loads(file.metadata()[TIED_KEY]) == [TIE] and file.metadata()["task"] == GPT2
    state = load_file(str(path))
    assert state.keys() == model.state_dict().keys()
    assert torch.equal(state[TIE[0]], state[TIE[1]])
    fresh = type(model)(model.config)
    fresh.load_state_dict(state, strict=True)  # as anyone loads it, nothing of ours
    assert max_abs_diff(fresh.state_dict(), model.state_dict()) == 0


def test_loading_keeps_the_tie_one_storage_that_trains_as_one(tmp_path):
    trained = _gpt2()
    with torch.no_grad():
        trained.lm_head.weight.add_(1.0)  # the embedding too: one tensor
    path = save_weights(trained, tmp_path / "model.safetensors")
    model = load_weights(_gpt2(), path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, trained.transformer.wte.weight)
    model.lm_head.weight.data.mul_(0)
    assert model.transformer.wte.weight.abs().sum() == 0


def test_a_file_whose_copies_of_a_tied_tensor_differ_is_refused(tmp_path):
    state = {name: tensor.clone() for name, tensor in _gpt2().state_dict().items()}
    state["lm_head.weight"] += 1
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"ties lm_head\.weight to transformer\.wte\.weight"):
        load_weights(_gpt2(), tmp_path / "model.safetensors")


def test_weights_of_another_model_are_one_line_naming_the_first_missing_name(tmp_path):
    save_weights(SmallCNN(), tmp_path / "cnn.safetensors")
    with pytest.raises(WeightsError) as refused:
        load_weights(_gpt2(), tmp_path / "cnn.safetensors")
    assert "name(s) missing (first: lm_head.weight)" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(WeightsError, match="not a safetensors weights file"):
        load_weights(SmallCNN(), b"not safetensors")


def test_buffers_round_trip_persistent_ones_written_and_non_persistent_ones_not(tmp_path):
    model = SmallCNN()
    model.version.fill_(7.0)
    save_weights(model, tmp_path / "cnn.safetensors")
    state = load_file(str(tmp_path / "cnn.safetensors"))
    assert "version" in state and "pixel_mean" not in state and tied_groups(model) == []
    assert load_weights(SmallCNN(), tmp_path / "cnn.safetensors").version.item() == 7.0


class _Views(nn.Module):
    """Two buffers that are different views of one storage: shared memory, but not one tensor."""

    def __init__(self) -> None:
        super().__init__()
        whole = torch.arange(6.0)
        self.register_buffer("front", whole[:3])
        self.register_buffer("back", whole[3:])


def test_views_of_one_storage_that_are_not_one_tensor_are_written_apart_and_not_called_a_tie(tmp_path):
    model = _Views()
    assert tied_groups(model) == []
    state = load_file(str(save_weights(model, tmp_path / "views.safetensors")))
    assert state["front"].tolist() == [0, 1, 2] and state["back"].tolist() == [3, 4, 5]


# -- the final weights of a real run --------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """GPT-2 trained 2 steps in float64 on one worker (batch 8) and on two under ddp (4 each)."""
    root = tmp_path_factory.mktemp("gpt2-runs")
    runs = {}
    for workers, batch in ((1, 8), (2, 4)):
        runs[workers] = root / f"workers{workers}"
        result = run_cli("train", "--task", GPT2, "--steps", "2", "--batch-size", str(batch), "--workers",
                         str(workers), "--dtype", "float64", "--run-dir", str(runs[workers]), "--no-progress",
                         "--no-plot", timeout=240)
        runs[workers] = (runs[workers], result)
    return runs


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_trains_and_its_final_weights_load_strict_into_a_fresh_model_as_training_left_them(gpt2_runs,
                                                                                              workers):
    run_dir, result = gpt2_runs[workers]
    assert result.returncode == 0, result.stderr[-2000:]
    task = make_task(GPT2)
    built = task.build_model()
    fresh = type(built)(built.config).to(torch.float64).eval()  # a GPT2LMHeadModel from the config alone
    fresh.load_state_dict(load_file(str(run_dir / "final" / "model.safetensors")), strict=True)
    with torch.no_grad():  # the held-out loss training reported for the model it saved
        loss = task.metrics_fn(fresh(task.eval.inputs), task.eval.targets)["loss"]
    assert loss == pytest.approx(json.loads((run_dir / "report.json").read_text())["eval"]["loss"], abs=1e-12)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_gpt2_on_two_ddp_workers_ends_with_the_weights_of_one_worker(gpt2_runs):
    assert max_abs_diff(final_weights(gpt2_runs[1][0]), final_weights(gpt2_runs[2][0])) <= 1e-12


def test_a_model_assembled_from_a_state_dict_on_the_meta_device_is_tied_again(tmp_path):
    """How fsdp, tp and pipeline put the final model together (``assign=True`` gives every name its own
    tensor): the tie comes back where the values agree, and is left apart where they do not."""
    from mlscale.train.state import assemble

    state = {name: tensor.clone() for name, tensor in _gpt2().state_dict().items()}
    model = assemble(_gpt2, state)
    assert model.lm_head.weight is model.transformer.wte.weight and tied_groups(model) == [TIE]
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    state["lm_head.weight"] += 1  # trained apart: tying them would drop these values
    apart = assemble(_gpt2, state)
    assert tied_groups(apart) == [] and torch.equal(apart.lm_head.weight, state["lm_head.weight"])
