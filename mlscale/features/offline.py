"""Point-in-time-correct historical retrieval: for each entity row (join keys and an event time t),
each feature view's latest value at or before t, if it is no older than the view's TTL, else null.

Run as DuckDB ASOF LEFT JOINs straight over the Parquet sources, one per view:

- no future leakage: a row with an event time after t is never joined (``e.t >= f.t``);
- never a dropped row: a LEFT join, and the result is in the entity rows' order, one row each;
- TTL edges: a value exactly ``ttl`` old is valid, one microsecond older is null;
- ties: of source rows with the same keys and event time, the latest ``created_timestamp_column``
  wins, else the last in file order (files sorted by name): a late-arriving correction replaces
  what it corrects, as in Feast.

On-demand feature views are computed afterwards, in Python, from the retrieved columns, by the same
function that serving calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from mlscale.errors import UsageError, first_line
from mlscale.features.definitions import FeatureRepository, FeatureService, FeatureView

ROW = "__mlscale_row"
RESERVED_PREFIX = "__"  # the join's own column names: ROW, __t (the entity rows' time), __rank, __latest


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise UsageError("feature retrieval needs duckdb and pyarrow: pip install 'mlscale[features]'") from None
    return duckdb


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _entity_table(entity_rows: Any) -> Any:
    """A pyarrow table of the entity rows (a table, a pandas DataFrame, or a Parquet path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(entity_rows, (str, Path)):
        return pq.read_table(entity_rows)
    if isinstance(entity_rows, pa.Table):
        return entity_rows
    return pa.Table.from_pandas(entity_rows, preserve_index=False)


def source_sql(view: FeatureView, wanted: Sequence[str]) -> str:
    """The view's source, one row per (keys, event time): ties resolved as the module says."""
    source = view.source
    keys = ", ".join(_quote(k) for k in view.join_keys)
    columns = ", ".join(_quote(c) for c in wanted)
    order = f"{_quote(source.created_timestamp_column)} DESC NULLS LAST, " if source.created_timestamp_column else ""
    path = str(source.path).replace("'", "''")
    return (f"SELECT {keys}, CAST({_quote(source.timestamp_field)} AS TIMESTAMP) AS __t, {columns} FROM ("
            f"SELECT *, row_number() OVER (PARTITION BY {keys}, {_quote(source.timestamp_field)} "
            f"ORDER BY {order}filename DESC, file_row_number DESC) AS __rank "
            f"FROM read_parquet('{path}', filename=true, file_row_number=true)) WHERE __rank = 1")


def _view_sql(view: FeatureView, wanted: Sequence[str], names: dict[str, str]) -> str:
    """The entity rows (by row number) with this view's point-in-time values of ``wanted``."""
    on = " AND ".join(f"e.{_quote(k)} = f.{_quote(k)}" for k in view.join_keys)
    valid = "f.__t IS NOT NULL"
    if view.ttl is not None:
        valid += f" AND epoch_us(e.__t) - epoch_us(f.__t) <= {view.ttl // timedelta(microseconds=1)}"
    values = ", ".join(f"CASE WHEN {valid} THEN f.{_quote(c)} END AS {_quote(names[c])}" for c in wanted)
    return (f"SELECT e.{ROW}, {values} FROM entities e ASOF LEFT JOIN ({source_sql(view, wanted)}) f "
            f"ON {on} AND e.__t >= f.__t")


@contextmanager
def source_errors(view: FeatureView) -> Iterator[None]:
    """A source DuckDB cannot read (no files, a missing column) is one line naming the view."""
    duckdb = _duckdb()
    try:
        yield
    except (duckdb.IOException, duckdb.BinderException, duckdb.InvalidInputException) as exc:
        raise UsageError(f"feature view {view.name!r}: cannot read its source {view.source.path!r}: "
                         f"{first_line(exc)}") from None


def get_historical_features(repository: FeatureRepository, entity_rows: Any,
                            features: Sequence[str] | FeatureService, *, timestamp_field: str = "event_timestamp",
                            full_feature_names: bool = False) -> Any:
    """The entity rows with the features (``view:feature`` references, or a service's), as a pyarrow
    table: the entity columns, then one column per feature (named ``feature``, or ``view__feature``
    with ``full_feature_names``), in the entity rows' order."""
    import pyarrow as pa

    references = features.references() if isinstance(features, FeatureService) else list(features)
    resolved = repository.resolve(references)
    entities = _entity_table(entity_rows)
    reserved = [name for name in entities.column_names if name.startswith(RESERVED_PREFIX)]
    if reserved:  # the join's own columns (__t, __mlscale_row, ...): one of the rows' would take their place
        raise UsageError(f"the entity rows have a column named {reserved[0]!r}: names starting with "
                         f"{RESERVED_PREFIX!r} are mlscale's own in the point-in-time join; rename it")
    if timestamp_field not in entities.column_names:
        raise UsageError(f"the entity rows have no {timestamp_field!r} column (columns: "
                         f"{', '.join(entities.column_names)})")
    names = {ref: (ref.replace(":", "__") if full_feature_names else ref.partition(":")[2]) for ref in references}
    if len(set(names.values())) < len(names):
        raise UsageError("two features have the same name; pass full_feature_names=True")
    # what to read from each view: the features asked for, and the sources of on-demand views
    reads: dict[str, tuple[FeatureView, list[str]]] = {}
    for view, feature in resolved:
        needed = [(view, feature)] if isinstance(view, FeatureView) else \
            [(source, f) for source in view.sources for f in source.features]
        for source, name in needed:
            wanted = reads.setdefault(source.name, (source, []))[1]
            if name not in wanted:
                wanted.append(name)
    for view, _ in reads.values():
        missing = [k for k in view.join_keys if k not in entities.column_names]
        if missing:
            raise UsageError(f"the entity rows lack {', '.join(missing)}, the join key(s) of view {view.name!r}")

    duckdb = _duckdb()
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    table = entities.append_column(ROW, pa.array(np.arange(len(entities), dtype=np.int64)))
    con.register("entities_in", table)
    con.execute(f"CREATE TEMP TABLE entities AS SELECT *, CAST({_quote(timestamp_field)} AS TIMESTAMP) AS __t "
                f"FROM entities_in")
    retrieved: dict[str, np.ndarray | Any] = {}
    for view, wanted in reads.values():
        columns = {c: f"{view.name}__{c}" for c in wanted}
        with source_errors(view):
            result = con.sql(f"SELECT * FROM ({_view_sql(view, wanted, columns)}) ORDER BY {ROW}").to_arrow_table()
        for c in wanted:
            retrieved[f"{view.name}:{c}"] = result.column(columns[c])
    out = entities
    for (view, feature), reference in zip(resolved, references):
        if isinstance(view, FeatureView):
            column = retrieved[reference]
        else:
            inputs = view.inputs(lambda source, f: retrieved[f"{source.name}:{f}"].to_pylist())
            column = pa.array(view.transform(inputs)[feature])
        out = out.append_column(names[reference], column)
    return out
