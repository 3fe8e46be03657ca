"""ONNX export of every built-in task's model, checked against PyTorch with onnxruntime."""

import numpy as np
import pytest
import torch

from mlscale import TrainConfig, fit
from mlscale.errors import UsageError
from mlscale.export import ExportError, export_version
from mlscale.export.session import onnx_session
from mlscale.registry import LocalArtifactStore, Registry, load_torch_model, register_run
from mlscale.registry.artifacts import ArtifactExists
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
    fresh = register_run(registry, registry.resolve("models:/model1/1").source_run, "model1")
    with pytest.raises(ExportError, match="nothing was stored"):
        export_version(registry, fresh.uri, rtol=0.0, atol=1e-15)
    assert "model.onnx" not in registry.resolve(fresh.uri).artifacts
    assert not (registry.artifacts.root / "model1" / str(fresh.version) / "model.onnx").exists()


def test_a_second_export_of_a_version_is_a_no_op_and_other_bytes_are_refused(registry, tmp_path):
    first, _ = export_version(registry, "models:/model2/1")
    stored = registry.artifacts.root / first.key
    before = (stored.stat().st_ino, stored.stat().st_mtime_ns)
    again, parity = export_version(registry, "models:/model2/1")
    assert again.sha256 == first.sha256 and parity.passed
    assert registry.add_artifact("model2", 1, "model.onnx", stored, {}).sha256 == first.sha256  # same bytes
    other = tmp_path / "other.onnx"
    other.write_bytes(b"not the exported model")
    with pytest.raises(UsageError, match="write-once"):
        registry.add_artifact("model2", 1, "model.onnx", other, {})
    assert (stored.stat().st_ino, stored.stat().st_mtime_ns) == before  # never rewritten
    with pytest.raises(ExportError, match="stored ONNX export"):  # other tolerances: the stored file checked again
        export_version(registry, "models:/model2/1", rtol=0.0, atol=1e-15)
    assert export_version(registry, "models:/model2/1", rtol=1e-3, atol=1e-4)[1].passed
    registry.artifact_path(registry.resolve("models:/model2/1"), "model.onnx")  # still verifies
    actions = [h["action"] for h in registry.history("model2")]
    assert actions.count("add_artifact") == 1
    assert not [p for p in stored.parent.iterdir() if p.name.endswith(".tmp")]


def test_the_artifact_store_writes_once_and_never_over_an_existing_file(tmp_path):
    store = LocalArtifactStore(tmp_path / "artifacts")
    (tmp_path / "a").write_bytes(b"first")
    (tmp_path / "b").write_bytes(b"second")
    store.put("m/1/file", tmp_path / "a")
    with pytest.raises(ArtifactExists):
        store.put("m/1/file", tmp_path / "b")
    assert (tmp_path / "artifacts/m/1/file").read_bytes() == b"first"
    assert sorted(p.name for p in (tmp_path / "artifacts/m/1").iterdir()) == ["file"]


def test_cli_export_reports_parity_and_a_second_export_says_it_was_already_done(registry):
    fresh = register_run(registry, registry.resolve("models:/model0/1").source_run, "model0")
    location = registry.url.removeprefix("sqlite:///").removesuffix("/registry.db")
    first = run_cli("export", fresh.uri, "--format", "onnx", "--registry", location)
    assert first.returncode == 0, first.stderr
    assert "max abs error" in first.stdout and f"model0/{fresh.version}/model.onnx" in first.stdout
    assert "already exported" not in first.stdout
    second = run_cli("export", fresh.uri, "--registry", location)
    assert second.returncode == 0 and "already exported" in second.stdout and "max abs error" in second.stdout
