"""Mirroring a version into a real (SQLite-backed) MLflow tracking and registry store."""

import pytest

from mlscale.registry import Registry, register_run
from mlscale.registry.mlflow_mirror import mirror_version

mlflow = pytest.importorskip("mlflow")


def test_a_version_appears_in_mlflow_with_params_metrics_artifacts_and_aliases(tmp_path, trained_runs):
    from mlflow.tracking import MlflowClient

    registry = Registry(str(tmp_path / "registry"))
    register_run(registry, trained_runs["digits"], "digits")
    registry.set_alias("digits", 1, "champion")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = mirror_version(registry, registry.resolve("models:/digits@champion"), uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    mirrored = client.get_model_version_by_alias("digits", "champion")
    assert int(mirrored.version) == result["version"] and mirrored.tags["mlscale.uri"] == "models:/digits/1"
    run = client.get_run(result["run_id"])
    assert run.data.params["task"] == "digits" and run.data.params["batch_size"] == "32"
    assert 0 < run.data.metrics["eval.accuracy"] <= 1
    assert [a.path for a in client.list_artifacts(result["run_id"], "model")] == ["model/model.safetensors"]
