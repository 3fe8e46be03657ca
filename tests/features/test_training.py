"""Training from features: `mlscale train --features MODULE:SERVICE --entities FILE` builds the
training set by historical retrieval, learns from it, and records the features and their training
statistics in the run and in the registered version's lineage; only a declared repository loads."""

from __future__ import annotations

import importlib
import json
from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tests.feature_repo as repo_module
from mlscale.features import get_historical_features, load_service
from mlscale.registry import Registry
from tests.helpers import run_cli

T0 = datetime(2026, 5, 1)


@pytest.fixture
def feature_data(tmp_path, monkeypatch):
    """Users whose label is 1 when they spend more per visit than 10; activity changes over time."""
    rng = np.random.default_rng(3)
    users = np.arange(200)
    activity = [{"user_id": int(u), "event_timestamp": T0 + timedelta(hours=int(h)), "spend": float(s),
                 "visits": float(v)}
                for u in users for h, s, v in zip(rng.integers(0, 72, 3), rng.gamma(2, 10, 3), rng.integers(0, 5, 3))]
    pq.write_table(pa.Table.from_pylist(activity), tmp_path / "activity.parquet")
    pq.write_table(pa.Table.from_pylist([{"user_id": int(u), "event_timestamp": T0 - timedelta(days=30),
                                          "age": float(a)} for u, a in zip(users, rng.integers(18, 80, 200))]),
                   tmp_path / "profile.parquet")
    pq.write_table(pa.Table.from_pylist([{"user_id": int(u), "event_timestamp": T0 - timedelta(days=1),
                                          "tier": ["free", "pro", "team"][int(u) % 3]} for u in users[:180]]),
                   tmp_path / "plan.parquet")  # 20 users without a plan: missing
    monkeypatch.setenv("MLSCALE_TEST_FEATURE_DATA", str(tmp_path))
    moments = [T0 + timedelta(hours=int(h)) for h in rng.integers(24, 96, 600)]
    entity = pa.Table.from_pylist([{"user_id": int(u), "event_timestamp": t}
                                   for u, t in zip(rng.integers(0, 200, 600), moments)])


    importlib.reload(repo_module)  # its sources come from the directory just written
    repository, service = load_service("tests.feature_repo:model")
    values = get_historical_features(repository, entity, service)
    ratio = np.nan_to_num(values.column("spend_per_visit").to_numpy(zero_copy_only=False))
    labels = (ratio > 10).astype(np.int64)
    pq.write_table(entity.append_column("label", pa.array(labels)), tmp_path / "entities.parquet")
    order = np.argsort(np.array(moments, dtype="datetime64[us]"), kind="stable")
    spend = values.column("spend").to_numpy(zero_copy_only=False).astype(float)[order[:480]]
    return tmp_path, float(np.nanmean(spend))


def test_training_from_a_feature_service_records_its_features_and_statistics(feature_data, tmp_path):
    feature_data, training_spend_mean = feature_data
    result = run_cli("train", "--features", "tests.feature_repo:model", "--entities",
                     str(feature_data / "entities.parquet"), "--steps", "150", "--batch-size", "32", "--optimizer",
                     "adam", "--lr", "0.01", "--run-dir", str(tmp_path / "run"), "--no-progress",
                     "--register", "churn", "--registry", str(tmp_path / "registry"), timeout=240)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    features = report["features"]
    assert features["features"] == ["spend", "visits", "age", "spend_per_visit"]
    assert features["training_rows"] == 480 and features["held_out_rows"] == 120
    spend = features["statistics"]["spend"]
    assert spend["kind"] == "numeric" and 0 <= spend["null_fraction"] < 1 and sum(spend["counts"]) > 0
    assert spend["mean"] == pytest.approx(training_spend_mean, rel=1e-12)  # over the earliest 80%, by time
    assert features["statistics"]["age"]["skew_threshold"] == 0.3 and "skew_threshold" not in spend  # declared
    assert report["eval"]["accuracy"] > 0.8  # learnt from the retrieved features
    version = Registry(str(tmp_path / "registry")).resolve("models:/churn/1")
    assert version.metrics["features"] == features  # in the registered version's lineage


def test_an_undeclared_module_is_never_loaded_as_a_feature_repository(tmp_path):
    result = run_cli("train", "--features", "os:path", "--entities", str(tmp_path / "e.parquet"), "--steps", "1",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "not a declared feature repository" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_categorical_feature_is_one_hot_with_its_frequencies_recorded(feature_data, tmp_path):
    feature_data, _ = feature_data
    result = run_cli("train", "--features", "tests.feature_repo:with_tier", "--entities",
                     str(feature_data / "entities.parquet"), "--steps", "20", "--run-dir", str(tmp_path / "run"),
                     "--no-progress", timeout=240)
    assert result.returncode == 0, result.stderr
    features = json.loads((tmp_path / "run" / "report.json").read_text())["features"]
    tier = features["statistics"]["tier"]
    assert features["encoding"] == {"tier": ["free", "pro", "team"]}
    assert tier["kind"] == "categorical" and set(tier["frequencies"]) == {"free", "pro", "team"}
    assert sum(tier["frequencies"].values()) == round(480 * (1 - tier["null_fraction"]))
    from mlscale.features.encoding import model_matrix

    fields = load_service("tests.feature_repo:with_tier")[1].fields()
    matrix = model_matrix({"spend": [1.5, None], "visits": [2.0, 3.0], "tier": ["pro", "gold"]}, fields,
                          features["encoding"], 2)
    assert matrix.tolist() == [[1.5, 2.0, 0.0, 1.0, 0.0], [0.0, 3.0, 0.0, 0.0, 0.0]]  # unseen "gold": all 0
