"""The online store: materialized values served by entity key equal historical retrieval at the same
time, bit for bit, in SQLite and in the real Redis server; the TTL applies at the request's time."""

from __future__ import annotations

import struct
from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlscale.errors import UsageError
from mlscale.features import (
    Entity,
    FeatureRepository,
    FeatureService,
    FeatureView,
    Field,
    FileSource,
    get_historical_features,
    on_demand_feature_view,
)
from mlscale.features.online import RedisStore, SQLiteStore, get_online_features, materialize
from tests.features.conftest import REDIS_URL

T0 = datetime(2026, 3, 1)
USER = Entity("user", join_keys=["user_id"])


def _repository(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"user_id": int(u), "event_timestamp": T0 + timedelta(minutes=int(m)), "spend": float(s),
             "visits": int(v)}
            for u, m, s, v in zip(rng.integers(0, 20, 300), rng.integers(0, 600, 300), rng.normal(50, 20, 300),
                                  rng.integers(0, 9, 300))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "activity.parquet")
    activity = FeatureView("activity", [USER], [Field("spend"), Field("visits", "int64")],
                           FileSource(str(tmp_path / "activity.parquet")), ttl=timedelta(hours=4))

    @on_demand_feature_view(sources=[activity], schema=[Field("spend_per_visit")])
    def per_visit(columns):
        return {"spend_per_visit": columns["spend"] / (columns["visits"] + 1.0)}

    service = FeatureService("model", [activity, per_visit])
    return FeatureRepository([USER], [activity, per_visit], [service]), service


def _bits(values):
    return [None if v is None else struct.pack("<d", v) if isinstance(v, float) else v for v in values]


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_served_features_equal_training_features_bit_for_bit(tmp_path, kind, request):
    repository, service = _repository(tmp_path)
    store = SQLiteStore(tmp_path / "online.db") if kind == "sqlite" else \
        RedisStore(REDIS_URL, prefix=request.getfixturevalue("redis_prefix"))
    end = T0 + timedelta(hours=10)
    written = materialize(repository, store, end_date=end)
    assert 0 < written["activity"] <= 20
    users = list(range(22))  # 20 and 21 have no data at all
    online = get_online_features(repository, store, service, [{"user_id": u} for u in users], at=end)
    entities = pa.Table.from_pylist([{"user_id": u, "event_timestamp": end} for u in users])
    offline = get_historical_features(repository, entities, service)
    for name in ("spend", "visits", "spend_per_visit"):
        assert _bits(online[name]) == _bits(offline.column(name).to_pylist()), name
    assert online["spend"][20] is None and online["spend"][21] is None
    assert any(v is not None for v in online["spend"])


def test_the_ttl_applies_at_the_request_time(tmp_path):
    repository, _ = _repository(tmp_path)
    store = SQLiteStore(tmp_path / "online.db")
    end = T0 + timedelta(hours=10)
    materialize(repository, store, end_date=end)
    latest = max(row[0] for row in store.read("activity", [(u,) for u in range(20)]) if row is not None)
    at_ttl = datetime(1970, 1, 1) + timedelta(microseconds=latest) + timedelta(hours=4)
    served = get_online_features(repository, store, ["activity:spend"], [{"user_id": u} for u in range(20)],
                                 at=at_ttl)
    past = get_online_features(repository, store, ["activity:spend"], [{"user_id": u} for u in range(20)],
                               at=at_ttl + timedelta(microseconds=1))
    assert sum(v is not None for v in served["spend"]) == sum(v is not None for v in past["spend"]) + 1


def _typed_repository(tmp_path, dtype):
    """One view over int user ids, its entity declaring ``dtype`` (None: undeclared)."""
    pq.write_table(pa.Table.from_pylist([{"user_id": u, "event_timestamp": T0, "spend": 10.0 + u} for u in range(5)]),
                   tmp_path / "spend.parquet")
    user = Entity("user", join_keys=["user_id"], dtype=dtype)
    view = FeatureView("spend", [user], [Field("spend")], FileSource(str(tmp_path / "spend.parquet")))
    repository = FeatureRepository([user], [view])
    store = SQLiteStore(tmp_path / "online.db")
    materialize(repository, store, end_date=T0 + timedelta(hours=1))
    return repository, store


@pytest.mark.parametrize("key", ["3", 3.0, None, True, [3], {"id": 3}, 1 << 64])
def test_an_entity_key_of_the_wrong_type_is_refused_not_served_as_an_unknown_entity(tmp_path, key):
    repository, store = _typed_repository(tmp_path, "int64")
    assert get_online_features(repository, store, ["spend:spend"], [{"user_id": 3}], at=T0)["spend"] == [13.0]
    with pytest.raises(UsageError, match=r"entity row 1: user_id=.* entity 'user'") as refused:
        get_online_features(repository, store, ["spend:spend"], [{"user_id": 3}, {"user_id": key}], at=T0)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("key", [3.0, None, False])
def test_an_undeclared_entity_key_type_still_refuses_what_is_neither_an_integer_nor_a_string(tmp_path, key):
    repository, store = _typed_repository(tmp_path, None)
    with pytest.raises(UsageError, match="an integer or a string"):
        get_online_features(repository, store, ["spend:spend"], [{"user_id": key}], at=T0)
    assert get_online_features(repository, store, ["spend:spend"], [{"user_id": np.int64(4)}],
                               at=T0)["spend"] == [14.0]


def test_materializing_keys_of_another_type_than_the_entity_declares_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"feature view 'spend': a key in its source .*user_id=0 is an integer, "
                       "but entity 'user' has a string"):
        _typed_repository(tmp_path, "string")
    with pytest.raises(UsageError, match="bad value dtype='float64' of entity 'user'"):
        Entity("user", dtype="float64")
