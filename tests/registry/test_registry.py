"""The registry on a real SQLite file: versions, stages, aliases, lineage, audit log, verified artifacts."""

import json
import shutil

import pytest
import torch

from mlscale import TrainConfig, fit
from mlscale.errors import MlscaleError, UsageError
from mlscale.registry import ArtifactIntegrityError, NotFound, Registry, load_torch_model, register_run, schema
from tests.helpers import run_cli


@pytest.fixture
def registry(tmp_path):
    return Registry(str(tmp_path / "registry"))


def test_versions_are_numbered_in_order_with_lineage(registry, trained_runs):
    first = register_run(registry, trained_runs["digits"], "digits", description="baseline", tags={"team": "ml"})
    second = register_run(registry, trained_runs["digits"], "digits")
    assert (first.version, second.version) == (1, 2) and first.uri == "models:/digits/1"
    assert first.stage == "None" and first.description == "baseline" and first.tags == {"team": "ml"}
    assert first.config["task"] == "digits" and first.metrics["eval"]["accuracy"] > 0
    assert first.data_fingerprint.startswith("sha256:") and first.code_version["mlscale"]
    assert first.source_run == str(trained_runs["digits"].resolve())
    assert first.signature["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert first.signature["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    report = json.loads((trained_runs["digits"] / "report.json").read_text())
    assert report["model_uri"] == "models:/digits/2"


def test_stages_aliases_and_the_audit_log(registry, trained_runs):
    for _ in range(3):
        register_run(registry, trained_runs["digits"], "digits")
    registry.set_stage("digits", 1, "Production")
    registry.set_stage("digits", 2, "production", archive_existing=True)
    assert registry.get_version("digits", 1).stage == "Archived"
    assert registry.resolve("models:/digits/Production").version == 2
    registry.set_alias("digits", 2, "champion")
    assert registry.resolve("models:/digits@champion").version == 2
    registry.set_alias("digits", 3, "champion")  # aliases move
    assert registry.resolve("models:/digits@champion").version == 3
    assert registry.get_version("digits", 2).aliases == []
    registry.delete_alias("digits", "champion")
    with pytest.raises(NotFound, match="alias 'champion'"):
        registry.resolve("models:/digits@champion")
    actions = [(h["version"], h["action"], h["from_value"], h["to_value"]) for h in registry.history("digits")]
    assert (1, "stage", "None", "Production") in actions
    assert (1, "stage", "Production", "Archived") in actions
    assert (2, "stage", "None", "Production") in actions
    assert (3, "alias:champion", "2", "3") in actions and (3, "alias:champion", "3", None) in actions
    assert all(h["who"] and h["at"] for h in registry.history("digits"))


def test_a_registered_model_loads_back_with_the_trained_weights(registry, trained_runs):
    version = register_run(registry, trained_runs["digits-cnn"], "cnn")
    model = load_torch_model(registry, registry.resolve("models:/cnn/1"))
    from safetensors.torch import load_file

    trained = load_file(str(trained_runs["digits-cnn"] / "final" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    assert not model.training and version.artifacts["model.safetensors"].size_bytes > 0


@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
def test_a_tampered_or_truncated_artifact_is_refused(registry, trained_runs, damage):
    version = register_run(registry, trained_runs["digits"], "digits")
    path = registry.artifacts.root / version.artifacts["model.safetensors"].key
    data = bytearray(path.read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match="refusing to load"):
        load_torch_model(registry, version)


def test_a_failed_registration_leaves_no_orphan_version(registry, trained_runs):
    register_run(registry, trained_runs["digits"], "digits")
    weights = trained_runs["digits"] / "final" / "model.safetensors"
    with pytest.raises(TypeError):  # the config cannot be stored: fails inside the transaction
        registry.create_version("digits", {"model.safetensors": weights}, config={"bad": object()}, metrics={},
                                signature={})
    assert [v.version for v in registry.versions("digits")] == [1]
    assert sorted(p.name for p in (registry.artifacts.root / "digits").iterdir()) == ["1"]
    assert register_run(registry, trained_runs["digits"], "digits").version == 2


def test_unknown_names_versions_aliases_and_stages_are_clear_errors(registry, trained_runs):
    register_run(registry, trained_runs["digits"], "digits")
    with pytest.raises(NotFound, match="no registered model named 'nope'"):
        registry.resolve("models:/nope/1")
    with pytest.raises(NotFound, match="has no version 7"):
        registry.resolve("models:/digits/7")
    with pytest.raises(NotFound, match="no version in stage Staging"):
        registry.resolve("models:/digits/Staging")
    with pytest.raises(UsageError, match="stage='Prod'"):
        registry.set_stage("digits", 1, "Prod")
    with pytest.raises(UsageError, match="bad value name"):
        register_run(registry, trained_runs["digits"], "no spaces please")


def test_a_newer_schema_is_refused(tmp_path):
    from sqlalchemy import update

    from mlscale.registry import RegistryError

    registry = Registry(str(tmp_path / "r"))
    with registry.engine.begin() as conn:
        conn.execute(update(schema.schema_info).values(version=schema.SCHEMA_VERSION + 1))
    with pytest.raises(RegistryError, match="newer than this mlscale"):
        Registry(str(tmp_path / "r"))


def test_cli_register_stage_alias_show_and_bad_input(tmp_path, trained_runs):
    reg = ["--registry", str(tmp_path / "cli-registry")]
    result = run_cli("models", "register", str(trained_runs["digits"]), "--name", "digits", "--json", *reg)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["uri"] == "models:/digits/1"
    assert run_cli("models", "stage", "digits", "1", "Production", *reg).returncode == 0
    assert run_cli("models", "alias", "digits", "1", "champion", *reg).returncode == 0
    shown = run_cli("models", "show", "digits", *reg)
    assert "Production" in shown.stdout and "champion" in shown.stdout and "history" in shown.stdout
    lineage = run_cli("models", "show", "models:/digits@champion", *reg).stdout
    assert "sha256:" in lineage and "input FP32 [-1, 64] -> output FP32 [-1, 10]" in lineage
    listed = json.loads(run_cli("models", "list", "--json", *reg).stdout)
    assert listed[0]["stages"] == {"Production": 1} and listed[0]["aliases"] == {"champion": 1}
    for args, code, text in [(["models", "show", "models:/digits/9"], 2, "has no version 9"),
                             (["models", "show", "nope"], 2, "no registered model named 'nope'"),
                             (["models", "stage", "digits", "1", "Gold"], 2, "stage='Gold'"),
                             (["models", "register", str(tmp_path), "--name", "x"], 2, "no report.json"),
                             (["export", "models:/digits@nobody"], 2, "alias 'nobody'")]:
        result = run_cli(*args, *reg)
        assert result.returncode == code and text in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_an_unreachable_database_is_one_line_and_exit_1():
    result = run_cli("models", "list", "--registry", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert result.returncode == 1 and "cannot reach the registry database" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_lineage_says_when_the_source_run_directory_now_holds_another_run(tmp_path):
    location = str(tmp_path / "registry")
    run_dir = tmp_path / "runs" / "demo"
    fit(TrainConfig(task="digits", steps=5, run_dir=str(run_dir)))
    version = register_run(Registry(location), run_dir, "digits")
    shown = run_cli("models", "show", version.uri, "--registry", location)
    assert f"{run_dir.resolve()} (verified)" in shown.stdout
    shutil.rmtree(run_dir)  # a later demo reuses the folder for another run
    fit(TrainConfig(task="digits", steps=5, seed=1, run_dir=str(run_dir)))
    shown = run_cli("models", "show", "digits", "--registry", location)
    assert "changed: the directory now holds another run" in shown.stdout
    shutil.rmtree(run_dir)
    assert Registry(location).resolve(version.uri).source_run_state() == "gone"


def test_two_registries_sharing_an_artifact_folder_never_replace_each_others_files(tmp_path, trained_runs):
    first = Registry(str(tmp_path / "shared"))  # artifacts in shared/artifacts
    second = Registry(f"sqlite:///{tmp_path / 'shared' / 'other.db'}")  # the same artifact folder
    version = register_run(first, trained_runs["digits"], "m")
    with pytest.raises(MlscaleError, match="belong to another registry"):
        register_run(second, trained_runs["digits-cnn"], "m")
    load_torch_model(first, first.resolve(version.uri))  # the first registry's weights are intact
    assert second.list_models() == []  # nothing half-registered in the second
