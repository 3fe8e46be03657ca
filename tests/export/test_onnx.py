"""ONNX export of every built-in task's model, checked against PyTorch with onnxruntime."""

import numpy as np
import pytest
import torch

from mlscale import TrainConfig, fit
from mlscale.export import ExportError, export_version
from mlscale.export.session import onnx_session
from mlscale.registry import Registry, load_torch_model, register_run
from tests.helpers import run_cli

TASKS = [("digits", {}), ("digits-cnn", {}), ("synthetic", {"samples": 512, "width": 64}),
         ("synthetic", {"kind": "regression", "samples": 512, "width": 64})]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    registry = Registry(str(root / "registry"))
    for i, (task, options) in enumerate(TASKS):
        fit(TrainConfig(task=task, task_options=options, steps=10, run_dir=str(root / f"run{i}")))
        register_run(registry, root / f"run{i}", f"model{i}")
    return registry


@pytest.mark.parametrize("index", range(len(TASKS)))
def test_every_builtin_model_exports_within_tolerance_with_a_dynamic_batch(registry, index):
    _artifact, parity = export_version(registry, f"models:/model{index}/1")
    assert parity.passed and parity.max_abs_err <= 1e-5 and parity.batch_sizes == [1, 7, 64, parity.samples - 72]
    version = registry.resolve(f"models:/model{index}/1")
    assert version.artifacts["model.onnx"].info["parity"]["max_abs_err"] == parity.max_abs_err
    session = onnx_session(registry.artifact_path(version, "model.onnx"))
    model = load_torch_model(registry, version)
    for batch in (3, 50):
        inputs = torch.randn(batch, *version.signature["inputs"][0]["shape"][1:])
        out = session.run(["output"], {"input": inputs.numpy()})[0]
        np.testing.assert_allclose(out, model(inputs).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_an_export_outside_tolerance_fails_loudly_and_stores_nothing(registry):
    with pytest.raises(ExportError, match="nothing was stored"):
        export_version(registry, "models:/model1/1", rtol=0.0, atol=1e-15)
    version = registry.resolve("models:/model1/1")
    stored = version.artifacts.get("model.onnx")
    assert stored is None or stored.info["parity"]["atol"] == 1e-5  # only a passing export is ever stored


def test_cli_export_reports_parity(tmp_path, registry):
    result = run_cli("export", "models:/model0/1", "--format", "onnx", "--registry", str(registry.url.removeprefix(
        "sqlite:///").removesuffix("/registry.db")))
    assert result.returncode == 0, result.stderr
    assert "max abs error" in result.stdout and "model0/1/model.onnx" in result.stdout
