"""Models nobody here wrote through the registry: registered from a run by the CLI, loaded back with
their ties (GPT-2's head is its embedding: one storage) and their buffers."""

from __future__ import annotations

import pytest
import torch

from mlscale.registry import Registry, load_torch_model
from mlscale.tasks import make_task
from mlscale.weights import tied_groups
from tests.helpers import final_weights, max_abs_diff, run_cli, user_models_registry

# Trained runs of Hugging Face models built by the first test that needs them: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return user_models_registry(tmp_path_factory).parent


def test_a_registered_gpt2_loads_back_with_its_head_still_its_embedding(runs, tmp_path):
    location = str(tmp_path / "registry")
    registered = run_cli("models", "register", str(runs / "gpt2"), "--name", "lm", "--registry", location)
    assert registered.returncode == 0, registered.stderr
    registry = Registry(location)
    version = registry.resolve("models:/lm/1")
    assert version.signature["inputs"][0] == {"name": "input", "datatype": "INT64", "shape": [-1, 16],
                                              "range": [0, 31]}
    assert version.signature["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 16, 32]}]
    model = load_torch_model(registry, version)
    assert model.lm_head.weight is model.transformer.wte.weight and tied_groups(model) == [
        ["transformer.wte.weight", "lm_head.weight"]]
    assert max_abs_diff(model.state_dict(), final_weights(runs / "gpt2")) == 0
    assert not torch.equal(model.lm_head.weight, make_task("tests.user_models:gpt2").build_model().lm_head.weight)


def test_a_registered_cnn_keeps_its_persistent_buffer_and_its_dict_output_signs_the_logits(runs):
    registry = Registry(str(runs / "registry"))
    version = registry.resolve("models:/cnn/1")
    assert version.signature["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    model = load_torch_model(registry, version)
    assert max_abs_diff(model.state_dict(), final_weights(runs / "cnn")) == 0
    assert model.pixel_mean.item() == pytest.approx(0.3)  # non-persistent: as the model builds it
