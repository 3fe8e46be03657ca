"""The registry on a real SQLite file: versions, stages, aliases, lineage, audit log, verified artifacts."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from mlscale import TrainConfig, fit
from mlscale.errors import MlscaleError, UsageError
from mlscale.registry import ArtifactIntegrityError, NotFound, Registry, load_torch_model, register_run, schema
from mlscale.registry.artifacts import LocalArtifactStore
from tests.helpers import REPO, final_weights, max_abs_diff, run_cli


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


class CaseFoldingStore(LocalArtifactStore):
    """Artifacts on a simulated case-insensitive file system (macOS, Windows): keys that differ only by
    case are one file, as they would be there (the files are real, under a lower-cased key)."""

    def _path(self, key):
        return super()._path(key.lower())


def _case_folding_registry(tmp_path):
    return Registry(str(tmp_path / "registry"), artifacts=CaseFoldingStore(tmp_path / "registry" / "artifacts"))


def test_a_name_that_differs_only_by_case_is_refused_and_the_existing_models_files_are_kept(tmp_path, trained_runs):
    registry = _case_folding_registry(tmp_path)
    digits = register_run(registry, trained_runs["digits"], "digits")
    with pytest.raises(UsageError, match="bad value name='Digits': model 'digits' exists"):
        register_run(registry, trained_runs["digits-cnn"], "Digits")
    load_torch_model(registry, registry.resolve(digits.uri))  # its files are intact: verified and loaded
    assert [m["name"] for m in registry.list_models()] == ["digits"]
    result = run_cli("models", "register", str(trained_runs["digits-cnn"]), "--name", "DIGITS", "--registry",
                     str(tmp_path / "registry"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "'digits'" in result.stderr


def test_the_folder_of_a_committed_version_is_never_removed_by_a_registration(tmp_path, trained_runs):
    """A registry from before the case check holds both names (a case-sensitive disk, then moved): a
    registration whose folder is a committed version's where case is not told apart is refused, and
    neither that folder nor anything else of the committed version is removed."""
    registry = _case_folding_registry(tmp_path)
    digits = register_run(registry, trained_runs["digits"], "digits")
    with registry.engine.begin() as conn:  # as an older registry would hold it
        conn.exec_driver_sql(f"DROP INDEX {schema.FOLDED_NAME_INDEX}")
        conn.execute(schema.models.insert().values(name="Digits", description="", created_at="x", updated_at="x"))
    with pytest.raises(MlscaleError, match=r"artifact folder is that of models:/digits/1 .* nothing was replaced"):
        register_run(registry, trained_runs["digits-cnn"], "Digits")
    load_torch_model(registry, registry.resolve(digits.uri))
    folder = tmp_path / "registry" / "artifacts" / "digits"
    assert sorted(p.name for p in folder.iterdir()) == ["1"]  # no staging folder left either


class SwappingStore(LocalArtifactStore):
    """A writer that replaces a version's file right after each check (another process with access to
    the artifact folder): the swap is real, on the file system, between the check and any later read."""

    def __init__(self, root, replacement):
        super().__init__(root)
        self.replacement = replacement

    def _swap(self, key):
        shutil.copyfile(self.replacement, self._path(key))

    def fetch(self, key, sha256):
        path = super().fetch(key, sha256)
        self._swap(key)
        return path

    def fetch_bytes(self, key, sha256):
        data = super().fetch_bytes(key, sha256)
        self._swap(key)
        return data


def test_the_bytes_hashed_are_the_bytes_loaded(tmp_path, trained_runs):
    digits, other = trained_runs["digits"], tmp_path / "other"
    fit(TrainConfig(task="digits", steps=2, seed=7, run_dir=str(other)))
    store = SwappingStore(tmp_path / "registry" / "artifacts", other / "final" / "model.safetensors")
    registry = Registry(str(tmp_path / "registry"), artifacts=store)
    version = register_run(registry, digits, "digits")
    model = load_torch_model(registry, version)
    registered = final_weights(digits)
    assert max_abs_diff(registered, dict(model.state_dict())) == 0  # the verified weights, not the swapped ones
    with pytest.raises(ArtifactIntegrityError):  # the file now is the swapped one: the next load refuses it
        load_torch_model(registry, version)


def test_an_onnx_session_runs_the_verified_bytes(tmp_path, trained_runs):
    """What serving and the export run: a session made from the artifact's verified bytes."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from mlscale.export.session import onnx_session

    def graph(op, path):
        node = helper.make_node(op, ["input"], ["output"])
        spec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 2]) for n in ("input", "output")]
        model = helper.make_model(helper.make_graph([node], "g", [spec[0]], [spec[1]]),
                                  opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, path)
        return path

    identity, negate = graph("Identity", tmp_path / "identity.onnx"), graph("Neg", tmp_path / "neg.onnx")
    store = SwappingStore(tmp_path / "registry" / "artifacts", negate)
    registry = Registry(str(tmp_path / "registry"), artifacts=store)
    version = register_run(registry, trained_runs["digits"], "digits")
    registry.add_artifact("digits", version.version, "model.onnx", identity, {})
    version = registry.resolve(version.uri)
    session = onnx_session(registry.artifact_bytes(version, "model.onnx"))
    batch = np.array([[1.0, -2.0]], dtype=np.float32)
    assert session.run(["output"], {"input": batch})[0].tolist() == batch.tolist()  # Identity, not Neg


@pytest.mark.parametrize("url", ["postgresql+psycopg://user:s3cr@tPW@127.0.0.1:1/db",
                                 "postgresql+psycopg://user:s3cr@tPW:9@127.0.0.1:1/db",  # was a traceback
                                 "postgresql+psycopg://user:s3cr@tPW@127.0.0.1:1/db?sslmode=disable"])
@pytest.mark.parametrize("given", ["flag", "environment"])
def test_a_malformed_registry_url_is_one_line_exit_2_with_no_part_of_the_password(url, given):
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"MLSCALE_REGISTRY": url} if given == "environment" else {})}
    args = ["--registry", url] if given == "flag" else []
    result = subprocess.run([sys.executable, "-m", "mlscale", "models", "list", *args], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, output
    assert "percent-encode" in result.stderr and "Traceback" not in output
    for piece in ("s3cr", "tPW"):
        assert piece not in output


def test_an_unreachable_database_names_it_without_its_password():
    result = run_cli("models", "list", "--registry", "postgresql+psycopg://nobody:Pa55word@127.0.0.1:1/none")
    assert result.returncode == 1 and "postgresql+psycopg://nobody:***@127.0.0.1:1/none" in result.stderr
    assert "Pa55word" not in result.stdout + result.stderr
