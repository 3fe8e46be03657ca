"""The online store: ``materialize`` writes each entity's latest feature values (at or before an end
time) into a key-value store, and ``get_online_features`` looks them up by entity key for serving,
applying the TTL at the request's time and the same on-demand transformations as training.

Stores: SQLite (a file; the default) and Redis (``redis://`` URL). A value is written as JSON, whose
floats round-trip exactly (the shortest repr of a float64), so the vector a model is served is bit for
bit the one historical retrieval gives for the same entity and time.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson

from mlscale.errors import UsageError
from mlscale.features.definitions import FeatureRepository, FeatureService, FeatureView
from mlscale.features.offline import _duckdb, _quote, source_errors, source_sql

Key = tuple[Any, ...]
Record = tuple[int, dict[str, Any]]  # (event time in microseconds since the epoch, values)
EPOCH = datetime(1970, 1, 1)


class OnlineStore(Protocol):
    def write(self, view: str, rows: Sequence[tuple[Key, Record]]) -> None: ...

    def read(self, view: str, keys: Sequence[Key]) -> list[Record | None]: ...


def _key(key: Key) -> str:
    return orjson.dumps(list(key)).decode()


class SQLiteStore:
    """One table per view: entity key (JSON) -> event time, values (JSON)."""

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # timeout: how long a read waits for a writer's lock (sqlite's busy timeout)
        self.connection = sqlite3.connect(self.path, check_same_thread=False, timeout=timeout_s)
        self.connection.execute("PRAGMA journal_mode=WAL")

    @staticmethod
    def _table(view: str) -> str:
        return _quote(f"view_{view}")

    def write(self, view: str, rows: Sequence[tuple[Key, Record]]) -> None:
        table = self._table(view)
        with self.connection:
            self.connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, event_us INTEGER, "
                                    "value BLOB)")
            self.connection.executemany(f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?)",
                                        [(_key(k), t, orjson.dumps(v)) for k, (t, v) in rows])

    def read(self, view: str, keys: Sequence[Key]) -> list[Record | None]:
        names = [_key(k) for k in keys]
        try:
            found = dict(((k, (t, v)) for k, t, v in self.connection.execute(
                f"SELECT key, event_us, value FROM {self._table(view)} WHERE key IN "
                f"({','.join('?' * len(names))})", names)))
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # nothing materialized for this view
                return [None] * len(keys)
            raise  # locked past the timeout, unreadable: the store failed, the entities are not unknown
        return [(found[n][0], orjson.loads(found[n][1])) if n in found else None for n in names]


class RedisStore:
    """``PREFIX:VIEW:KEY`` -> JSON [event time, values], in the Redis server at ``url``."""

    def __init__(self, url: str, prefix: str = "mlscale", timeout_s: float | None = None) -> None:
        """``timeout_s``: longest a connect or a reply may take (None: wait, as redis-py does)."""
        try:
            import redis
        except ImportError:
            raise UsageError("a Redis online store needs redis: pip install 'mlscale[features]'") from None
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix

    def _name(self, view: str, key: Key) -> str:
        return f"{self.prefix}:{view}:{_key(key)}"

    def write(self, view: str, rows: Sequence[tuple[Key, Record]]) -> None:
        pipeline = self.client.pipeline(transaction=False)
        for key, (t, values) in rows:
            pipeline.set(self._name(view, key), orjson.dumps([t, values]))
        pipeline.execute()

    def read(self, view: str, keys: Sequence[Key]) -> list[Record | None]:
        found = self.client.mget([self._name(view, key) for key in keys]) if keys else []
        return [None if raw is None else tuple(orjson.loads(raw)) for raw in found]  # type: ignore[misc]


def online_store(location: str | Path, timeout_s: float | None = None) -> OnlineStore:
    """``redis://...`` -> Redis; anything else is a SQLite file. ``timeout_s``: longest one read may
    wait on the store (a server that does not answer, a file locked by a writer)."""
    text = str(location)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(text, timeout_s=timeout_s)
    return SQLiteStore(text) if timeout_s is None else SQLiteStore(text, timeout_s=timeout_s)


def _micros(moment: datetime) -> int:
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc).replace(tzinfo=None)
    return (moment - EPOCH) // timedelta(microseconds=1)


def _python(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def materialize(repository: FeatureRepository, store: OnlineStore, end_date: datetime,
                views: Sequence[str] | None = None) -> dict[str, int]:
    """Write each entity's latest values at or before ``end_date`` (ties as in historical retrieval);
    returns the rows written per view."""
    written = {}
    con = _duckdb().connect()
    con.execute("SET TimeZone = 'UTC'")
    for view in repository.views:
        if not isinstance(view, FeatureView) or (views is not None and view.name not in views):
            continue
        keys = ", ".join(_quote(k) for k in view.join_keys)
        columns = ", ".join(_quote(c) for c in view.features)
        with source_errors(view):  # of the rows at or before the end (ties resolved), each entity's latest
            rows = con.execute(
                f"SELECT {keys}, epoch_us(__t), {columns} FROM (SELECT *, row_number() OVER (PARTITION BY {keys} "
                f"ORDER BY __t DESC) AS __latest FROM ({source_sql(view, view.features)}) WHERE __t <= ?) "
                "WHERE __latest = 1", [end_date]).fetchall()
        width = len(view.join_keys)
        _check_source_keys(view, rows, width)
        store.write(view.name, [(tuple(row[:width]), (row[width], dict(zip(view.features, row[width + 1:]))))
                                for row in rows])
        written[view.name] = len(rows)
    return written


def _check_source_keys(view: FeatureView, rows: Sequence[tuple[Any, ...]], width: int) -> None:
    """The keys written must be keys a request can name: of their entity's type."""
    entities = view.key_entities()
    for row in rows:
        for (name, entity), value in zip(entities, row[:width]):
            problem = entity.key_error(name, value)
            if problem is not None:
                raise UsageError(f"feature view {view.name!r}: a key in its source {view.source.path!r}: {problem}")


def _entity_keys(view: FeatureView, entity_rows: Sequence[dict[str, Any]]) -> list[Key]:
    """Each row's key in ``view``, its values checked against their entity's type (``UsageError``, which
    serving answers 400): a key of the wrong type would find nothing and serve the unknown-entity vector."""
    entities = view.key_entities()
    keys = []
    for index, row in enumerate(entity_rows):
        key = []
        for name, entity in entities:
            if name not in row:
                raise UsageError(f"an entity row lacks {name!r}, a join key of view {view.name!r}")
            value = row[name]
            problem = entity.key_error(name, value)
            if problem is not None:
                raise UsageError(f"entity row {index}: {problem}")
            key.append(int(value) if isinstance(value, np.integer) else value)
        keys.append(tuple(key))
    return keys


def get_online_features(repository: FeatureRepository, store: OnlineStore, features: Sequence[str] | FeatureService,
                        entity_rows: Sequence[dict[str, Any]], at: datetime | None = None,
                        full_feature_names: bool = False) -> dict[str, list[Any]]:
    """The features of each entity row (a dict of its join keys), as columns: a value older than its
    view's TTL at ``at`` (default: now) is None, as historical retrieval at that time would give."""
    references = features.references() if isinstance(features, FeatureService) else list(features)
    resolved = repository.resolve(references)
    now = _micros(at or datetime.now(timezone.utc))
    cache: dict[str, list[dict[str, Any] | None]] = {}

    def values_of(view: FeatureView) -> list[dict[str, Any] | None]:
        if view.name not in cache:
            keys = _entity_keys(view, entity_rows)
            ttl_us = None if view.ttl is None else view.ttl // timedelta(microseconds=1)
            cache[view.name] = [None if record is None or (ttl_us is not None and now - record[0] > ttl_us)
                                else record[1] for record in store.read(view.name, keys)]
        return cache[view.name]

    out: dict[str, list[Any]] = {}
    for (view, feature), reference in zip(resolved, references):
        name = reference.replace(":", "__") if full_feature_names else feature
        if isinstance(view, FeatureView):
            out[name] = [None if values is None else values.get(feature) for values in values_of(view)]
        else:
            inputs = view.inputs(lambda source, f: [None if v is None else v.get(f) for v in values_of(source)])
            out[name] = [_python(v) for v in view.transform(inputs)[feature]]
    return out
