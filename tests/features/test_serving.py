"""Serving a model trained from features: a request names entities, the server looks their features up
in the online store and builds the same vector as training did, bit for bit."""

from __future__ import annotations

import importlib
import json
from datetime import datetime, timedelta, timezone

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tests.feature_repo as repo_module
from mlscale.features import get_historical_features, load_service
from mlscale.features.online import SQLiteStore, materialize
from tests.helpers import run_cli
from tests.serve.conftest import running_server


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A model trained with --features on recent data, and a materialized SQLite online store."""
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    rng = np.random.default_rng(11)
    users = range(50)
    pq.write_table(pa.Table.from_pylist([
        {"user_id": u, "event_timestamp": now - timedelta(minutes=int(m)), "spend": float(s), "visits": float(v)}
        for u in users for m, s, v in zip(rng.integers(10, 1400, 2), rng.gamma(2, 10, 2), rng.integers(0, 5, 2))]),
        tmp_path / "activity.parquet")
    pq.write_table(pa.Table.from_pylist([{"user_id": u, "event_timestamp": now - timedelta(days=30),
                                          "age": float(20 + u)} for u in users]), tmp_path / "profile.parquet")
    pq.write_table(pa.Table.from_pylist([{"user_id": u, "event_timestamp": now - timedelta(days=1), "tier": "pro"}
                                         for u in users]), tmp_path / "plan.parquet")
    monkeypatch.setenv("MLSCALE_TEST_FEATURE_DATA", str(tmp_path))
    importlib.reload(repo_module)
    entities = pa.Table.from_pylist([{"user_id": int(u), "event_timestamp": now - timedelta(minutes=int(m)),
                                      "label": int(u % 2)} for u, m in zip(rng.integers(0, 50, 200),
                                                                            rng.integers(0, 600, 200))])
    pq.write_table(entities, tmp_path / "entities.parquet")
    registry = str(tmp_path / "registry")
    trained = run_cli("train", "--features", "tests.feature_repo:model", "--entities",
                      str(tmp_path / "entities.parquet"), "--steps", "5", "--run-dir", str(tmp_path / "run"),
                      "--no-progress", "--register", "churn", "--registry", registry, timeout=240)
    assert trained.returncode == 0, trained.stderr
    repository, service = load_service("tests.feature_repo:model")
    store = tmp_path / "online.db"
    materialize(repository, SQLiteStore(store), end_date=now)
    return registry, repository, service, store


def trained_run(registry: str):
    """The run folder the fixture trained (beside its registry)."""
    from pathlib import Path

    return Path(registry).parent / "run"


def test_served_feature_vectors_equal_the_training_vectors_bit_for_bit(trained):
    registry, repository, service, store = trained
    asked = [{"user_id": u} for u in (3, 17, 42, 999)]  # 999: unknown, its features missing
    with running_server(registry, "models:/churn/1", "--online-store", str(store), "--runtime", "torch",
                        "--cache-mb", "0") as (base, _):
        answer = httpx.post(f"{base}/v2/models/churn/infer",
                            json={"parameters": {"entities": asked, "return_features": True}}).json()
        served = np.asarray(answer["parameters"]["feature_vectors"], dtype=np.float32)
        assert answer["parameters"]["features"] == ["spend", "visits", "age", "spend_per_visit"]
        assert answer["outputs"][0]["shape"] == [4, 2]
        predicted = httpx.post(f"{base}/predict", json={"entities": asked[:1]}).json()
        assert len(predicted["outputs"]) == 1
        missing_key = httpx.post(f"{base}/predict", json={"entities": [{"account": 1}]})
        assert missing_key.status_code == 400 and "user_id" in missing_key.json()["error"]
        for wrong in ("3", 3.0, None, True):  # not the entity 3: a 400, never the unknown entity's vector
            typed = httpx.post(f"{base}/predict", json={"entities": [{"user_id": wrong}]})
            assert typed.status_code == 400 and "entity 'user' has an integer" in typed.json()["error"], wrong
    rows = pa.Table.from_pylist([{"user_id": r["user_id"], "event_timestamp": datetime.now(timezone.utc)
                                  .replace(tzinfo=None)} for r in asked])
    training = get_historical_features(repository, rows, service)
    names = ["spend", "visits", "age", "spend_per_visit"]
    expected = np.nan_to_num(np.stack([np.asarray(training.column(n).to_numpy(zero_copy_only=False),
                                                  dtype=np.float64) for n in names], axis=1)).astype(np.float32)
    assert served.tobytes() == expected.tobytes()  # bit for bit
    assert not served[3].any()  # the unknown entity: every feature missing, fed as 0

    # a canary of a model served from features: sticky per entity, so a user always meets one version
    from mlscale.registry import Registry, register_run

    register_run(Registry(registry), trained_run(registry), "churn")  # version 2
    with running_server(registry, "models:/churn/1", "--canary", "models:/churn/2=50", "--online-store", str(store),
                        "--runtime", "torch", "--no-grpc") as (base, _):
        met = {}
        for _ in range(3):
            for user in range(30):
                answer = httpx.post(f"{base}/v2/models/churn/infer",
                                    json={"parameters": {"entities": [{"user_id": user}]}}).json()
                met.setdefault(user, set()).add(answer["model_version"])
    assert all(len(versions) == 1 for versions in met.values()), met
    assert set().union(*met.values()) == {"1", "2"}  # and the users are split between both



def test_the_server_measures_skew_and_the_cli_gates_on_it(trained, tmp_path):
    registry, _, _, store = trained
    log = tmp_path / "feature-log.db"
    with running_server(registry, "models:/churn/1", "--online-store", str(store), "--runtime", "torch",
                        "--cache-mb", "0", "--feature-log", str(log)) as (base, _):
        for user in range(0, 50, 10):
            httpx.post(f"{base}/predict", json={"entities": [{"user_id": u} for u in range(user, user + 10)]})
        gauges = [line for line in httpx.get(f"{base}/metrics").text.splitlines()
                  if line.startswith("mlscale_feature_skew{")]
        assert {line.split('feature="')[1].split('"')[0] for line in gauges} == {"spend", "visits", "age",
                                                                                  "spend_per_visit"}
        shifted = [((u,), (record[0], {**record[1], "spend": record[1]["spend"] * 50}))
                   for u in range(50) if (record := SQLiteStore(store).read("activity", [(u,)])[0]) is not None]
        SQLiteStore(store).write("activity", shifted)  # the pipeline upstream broke: spend 50x
        for _ in range(6):
            httpx.post(f"{base}/predict", json={"entities": [{"user_id": u} for u in range(50)]})
        served = {line.split('feature="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in httpx.get(f"{base}/metrics").text.splitlines()
                  if line.startswith("mlscale_feature_skew{")}
        from mlscale.ui.serving import ServerWatch  # the UI's serving page reads the same gauges

        skew = ServerWatch(base, slo_ms=100).poll()["versions"][0]["skew"]
        assert skew == pytest.approx(served) and skew["spend"] > skew["age"]
    report = run_cli("features", "skew", "models:/churn/1", "--log", str(log), "--registry", registry, "--json")
    assert report.returncode == 1, report.stderr  # past the threshold: a pipeline stops here
    rows = {row["feature"]: row for row in json.loads(report.stdout)["features"]}
    assert rows["spend"]["skewed"] and rows["spend_per_visit"]["skewed"] and not rows["age"]["skewed"]
    table = run_cli("features", "skew", "models:/churn/1", "--log", str(log), "--registry", registry)
    assert "SKEWED" in table.stdout and "spend" in table.stdout
