"""Export of models nobody here wrote: ONNX of GPT-2 (tied head, a ``ModelOutput``) and of a CNN that
returns a dict, each output being the model's predictions tensor and equal to PyTorch's; and
``mlscale export --format hf DIR``, a folder that ``from_pretrained`` loads into the same model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mlscale.export.session import onnx_session
from mlscale.registry import Registry, load_torch_model
from tests.helpers import run_cli, user_models_registry

# Trained runs of Hugging Face models built by the first test that needs them: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def location(tmp_path_factory):
    return str(user_models_registry(tmp_path_factory))


@pytest.fixture(scope="module")
def registry(location):
    return Registry(location)


def _inputs(name: str, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows)
    if name == "gpt2":
        return torch.randint(0, 32, (rows, 16), generator=generator)
    return torch.rand(rows, 64, generator=generator)


@pytest.mark.parametrize(("name", "predictions"), [("gpt2", lambda out: out.logits),
                                                   ("cnn", lambda out: out["logits"])])
def test_the_onnx_export_outputs_the_predictions_tensor_equal_to_pytorch(registry, name, predictions):
    version = registry.resolve(f"models:/{name}/1")
    assert version.artifacts["model.onnx"].info["parity"]["passed"]
    session = onnx_session(registry.artifact_path(version, "model.onnx"))
    assert [o.name for o in session.get_outputs()] == ["output"]
    model = load_torch_model(registry, version)
    for rows in (1, 5, 33):
        inputs = _inputs(name, rows)
        with torch.no_grad():
            expected = predictions(model(inputs)).numpy()
        np.testing.assert_allclose(session.run(["output"], {"input": inputs.numpy()})[0], expected,
                                   rtol=1e-4, atol=1e-5)


def test_export_hf_writes_a_folder_from_pretrained_loads_into_the_same_model(registry, location, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "exported" / "gpt2"
    result = run_cli("export", "models:/gpt2/1", "--format", "hf", str(folder), "--registry", location)
    assert result.returncode == 0, result.stderr
    assert "from_pretrained" in result.stdout and result.stderr == ""
    lineage = json.loads((folder / "mlscale.json").read_text())
    assert lineage["model_uri"] == "models:/gpt2/1"
    assert lineage["weights_sha256"] == registry.resolve("models:/gpt2/1").artifacts["model.safetensors"].sha256
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    original = load_torch_model(registry, registry.resolve("models:/gpt2/1"))
    assert type(loaded) is type(original) and loaded.lm_head.weight is loaded.transformer.wte.weight
    inputs = _inputs("gpt2", 9)
    with torch.no_grad():
        assert torch.equal(loaded(inputs).logits, original(inputs).logits)


@pytest.mark.parametrize(("args", "says"), [
    (["models:/cnn/1", "--format", "hf", "{tmp}/cnn"], "models:/cnn/1 is a SmallCNN, not a Hugging Face model"),
    (["models:/gpt2/1", "--format", "hf"], "--format hf writes a folder"),
    (["models:/gpt2/1", "{tmp}/onnx-here"], "an ONNX export is stored in the version"),
    (["models:/gpt2/1", "--format", "hf", "{tmp}/taken"], "exists and is not an empty folder"),
])
def test_export_refuses_what_it_cannot_do_in_one_line_with_exit_2(location, tmp_path, args, says):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("a user's file")
    args = [arg.format(tmp=tmp_path) for arg in args]
    result = run_cli("export", *args, "--registry", location)
    assert result.returncode == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "cnn").exists() and (tmp_path / "taken" / "keep.txt").exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging folder left
