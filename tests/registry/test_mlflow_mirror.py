"""Mirroring a version into a real (SQLite-backed) MLflow tracking and registry store."""

from mlscale.registry import Registry, register_run
from mlscale.registry.mlflow_mirror import mirror_version
from tests.conftest import require_module


def test_a_version_appears_in_mlflow_with_params_metrics_artifacts_and_aliases(tmp_path, trained_runs):
    require_module("mlflow")
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


def test_mirroring_the_same_version_twice_creates_no_second_run_or_version(tmp_path, trained_runs):
    require_module("mlflow")
    from mlflow.tracking import MlflowClient

    registry = Registry(str(tmp_path / "registry"))
    register_run(registry, trained_runs["digits"], "digits")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = mirror_version(registry, registry.resolve("models:/digits/1"), uri)
    registry.set_alias("digits", 1, "champion")  # an alias added since is brought over by the second mirror
    second = mirror_version(registry, registry.resolve("models:/digits/1"), uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert first["created"] and not second["created"]
    assert (second["version"], second["run_id"]) == (first["version"], first["run_id"])
    assert len(client.search_model_versions("name = 'digits'")) == 1
    experiment = client.get_experiment_by_name("mlscale")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    mirrored = client.get_model_version_by_alias("digits", "champion")
    assert mirrored.tags["mlscale.content_sha256"] and int(mirrored.version) == first["version"]


def test_a_mirror_error_shows_no_part_of_the_mlflow_password(tmp_path, trained_runs, monkeypatch, capfd):
    """MLflow's own message repeats the tracking URI, credentials and all: what is printed has none."""
    require_module("mlflow")
    import socket

    from mlscale.cli import main

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    registry = Registry(str(tmp_path / "registry"))
    register_run(registry, trained_runs["digits"], "digits")
    code = main(["models", "mirror", "models:/digits/1", "--registry", str(tmp_path / "registry"),
                 "--mlflow-uri", f"http://mirror:Pw-s3cr@t@127.0.0.1:{port}/"])
    out, err = capfd.readouterr()
    assert code == 1 and "MLflow at http://***@127.0.0.1" in err, err
    for piece in ("Pw-s3cr", "t@127", "s3cr"):
        assert piece not in out + err
