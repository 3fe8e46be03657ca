"""Point-in-time-correct historical retrieval: no leakage, no dropped rows, TTL edges, ties,
late-arriving corrections, several views in one call, on-demand views, and a brute-force reference
on random data."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

T0 = datetime(2026, 1, 1)
DRIVER = Entity("driver", join_keys=["driver_id"])


def _write(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _view(path, ttl=None, created=None, name="stats", fields=("rate",)) -> FeatureView:
    return FeatureView(name, [DRIVER], [Field(f) for f in fields], FileSource(str(path), "event_timestamp", created),
                       ttl=ttl)


def _entities(*rows) -> pa.Table:
    return pa.Table.from_pylist([{"driver_id": d, "event_timestamp": t} for d, t in rows])


def _get(view, entities, features=("stats:rate",), **options):
    repository = FeatureRepository([DRIVER], [view])
    return get_historical_features(repository, entities, list(features), **options).to_pylist()


def test_no_future_value_leaks_and_no_entity_row_is_dropped(tmp_path):
    source = _write(tmp_path / "s.parquet", [
        {"driver_id": 1, "event_timestamp": T0, "rate": 1.0},
        {"driver_id": 1, "event_timestamp": T0 + timedelta(hours=2), "rate": 2.0},  # after the first entity row
        {"driver_id": 2, "event_timestamp": T0 + timedelta(hours=5), "rate": 9.0},
    ])
    rows = _get(_view(source), _entities((1, T0 + timedelta(hours=1)), (1, T0 + timedelta(hours=2)),
                                         (2, T0 + timedelta(hours=1)), (3, T0), (1, T0 - timedelta(seconds=1))))
    assert [r["rate"] for r in rows] == [1.0, 2.0, None, None, None]  # None: kept, with nulls
    assert [r["driver_id"] for r in rows] == [1, 1, 2, 3, 1]  # the entity rows' order


def test_ttl_edges_exactly_at_the_ttl_and_one_microsecond_past(tmp_path):
    source = _write(tmp_path / "s.parquet", [{"driver_id": 1, "event_timestamp": T0, "rate": 1.0}])
    view = _view(source, ttl=timedelta(hours=1))
    at, past = T0 + timedelta(hours=1), T0 + timedelta(hours=1, microseconds=1)
    assert [r["rate"] for r in _get(view, _entities((1, at), (1, past), (1, T0)))] == [1.0, None, 1.0]


def test_ties_take_the_latest_created_row_and_else_the_last_in_file_order(tmp_path):
    rows = [{"driver_id": 1, "event_timestamp": T0, "rate": 1.0, "created": T0 + timedelta(minutes=5)},
            {"driver_id": 1, "event_timestamp": T0, "rate": 2.0, "created": T0 + timedelta(minutes=9)},  # latest
            {"driver_id": 1, "event_timestamp": T0, "rate": 3.0, "created": T0 + timedelta(minutes=1)}]
    source = _write(tmp_path / "s.parquet", rows)
    entity = _entities((1, T0))
    assert _get(_view(source, created="created"), entity)[0]["rate"] == 2.0
    assert _get(_view(source), entity)[0]["rate"] == 3.0  # no created column: the last row


def test_a_late_arriving_correction_in_a_later_file_replaces_the_value(tmp_path):
    (tmp_path / "src").mkdir()
    _write(tmp_path / "src/part-0.parquet", [{"driver_id": 1, "event_timestamp": T0, "rate": 1.0}])
    _write(tmp_path / "src/part-1.parquet", [{"driver_id": 1, "event_timestamp": T0, "rate": 1.5},  # corrected
                                             {"driver_id": 1, "event_timestamp": T0 + timedelta(days=1),
                                              "rate": 7.0}])
    rows = _get(_view(tmp_path / "src/*.parquet"), _entities((1, T0 + timedelta(hours=3))))
    assert rows[0]["rate"] == 1.5


def test_several_views_and_an_on_demand_view_in_one_call(tmp_path):
    stats = _view(_write(tmp_path / "a.parquet", [
        {"driver_id": 1, "event_timestamp": T0, "rate": 0.5, "trips": 10.0}]), fields=("rate", "trips"))
    profile = _view(_write(tmp_path / "b.parquet", [
        {"driver_id": 1, "event_timestamp": T0 - timedelta(days=3), "age": 41.0}]), name="profile", fields=("age",))

    @on_demand_feature_view(sources=[stats], schema=[Field("rate_per_trip")])
    def ratios(columns):
        return {"rate_per_trip": columns["rate"] / columns["trips"]}

    repository = FeatureRepository([DRIVER], [stats, profile, ratios])
    service = FeatureService("model", [stats, profile, ratios])
    table = get_historical_features(repository, _entities((1, T0), (2, T0)), service)
    assert table.column_names == ["driver_id", "event_timestamp", "rate", "trips", "age", "rate_per_trip"]
    first, second = table.to_pylist()
    assert (first["rate"], first["age"], first["rate_per_trip"]) == (0.5, 41.0, 0.05)
    assert second["rate"] is None and np.isnan(second["rate_per_trip"])
    full = get_historical_features(repository, _entities((1, T0)), ["stats:rate"], full_feature_names=True)
    assert full.column_names[-1] == "stats__rate"


def test_bad_references_and_entity_rows_are_one_line_errors(tmp_path):
    view = _view(_write(tmp_path / "s.parquet", [{"driver_id": 1, "event_timestamp": T0, "rate": 1.0}]))
    with pytest.raises(UsageError, match="unknown feature view 'nope'"):
        _get(view, _entities((1, T0)), features=["nope:rate"])
    with pytest.raises(UsageError, match="view 'stats' has rate"):
        _get(view, _entities((1, T0)), features=["stats:speed"])
    with pytest.raises(UsageError, match="lack driver_id"):
        _get(view, pa.Table.from_pylist([{"user": 1, "event_timestamp": T0}]))
    with pytest.raises(UsageError, match="no 'event_timestamp' column"):
        _get(view, pa.Table.from_pylist([{"driver_id": 1}]))
    with pytest.raises(UsageError, match="feature view 'stats': cannot read its source"):
        _get(_view(tmp_path / "missing.parquet"), _entities((1, T0)))


def _brute_force(source_rows, entity_rows, ttl):
    """Per entity row: the latest source row of its key at or before its time (ties: the last one
    written), if within the TTL."""
    out = []
    for key, t in entity_rows:
        best = None
        for position, (k, ts, value) in enumerate(source_rows):
            if k == key and ts <= t and (best is None or (ts, position) >= (best[0], best[1])):
                best = (ts, position, value)
        out.append(None if best is None or (ttl is not None and t - best[0] > ttl) else best[2])
    return out


moments = st.integers(0, 40).map(lambda m: T0 + timedelta(minutes=m))


@settings(max_examples=60, deadline=None)
@given(source=st.lists(st.tuples(st.integers(0, 3), moments, st.floats(-100, 100)), max_size=30),
       entity=st.lists(st.tuples(st.integers(0, 4), moments), min_size=1, max_size=20),
       ttl=st.one_of(st.none(), st.integers(0, 20).map(lambda m: timedelta(minutes=m))))
def test_retrieval_equals_a_brute_force_reference(tmp_path_factory, source, entity, ttl):
    path = tmp_path_factory.mktemp("random") / "s.parquet"
    schema = pa.schema([("driver_id", pa.int64()), ("event_timestamp", pa.timestamp("us")), ("rate", pa.float64())])
    pq.write_table(pa.Table.from_pylist([{"driver_id": k, "event_timestamp": t, "rate": v} for k, t, v in source],
                                        schema=schema), path)
    got = [r["rate"] for r in _get(_view(path, ttl=ttl), _entities(*entity))]
    assert got == _brute_force(source, entity, ttl)


@pytest.mark.parametrize("column", ["__t", "__mlscale_row", "__rank"])
def test_an_entity_column_named_like_one_of_the_joins_own_is_refused(tmp_path, column):
    source = _write(tmp_path / "s.parquet", [{"driver_id": 1, "event_timestamp": T0, "rate": 1.0}])
    later = T0 + timedelta(days=365)  # as __t, it would move the point in time past every row
    entities = pa.Table.from_pylist([{"driver_id": 1, "event_timestamp": T0 - timedelta(hours=1), column: later}])
    with pytest.raises(UsageError, match=f"a column named '{column}': names starting with '__' are mlscale's own"):
        _get(_view(source), entities)
