"""What a feature repository declares, named as Feast names it so that its users feel at home:
entities (what features describe, by their join keys), feature views (columns of a Parquet source with
event timestamps, valid for a TTL), on-demand feature views (a Python transformation of other
features, the same function at training and at serving) and feature services (what a model uses).

These are data with one exception, the on-demand transformation, which is code: it runs only when
its repository module declared it (``declare_repository``), as for tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from mlscale.errors import UsageError

DTYPES = ("float32", "float64", "int32", "int64", "bool", "string")
Columns = dict[str, np.ndarray]


KEY_DTYPES = ("int64", "string")
INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class Entity:
    """What features describe; rows are found by its ``join_keys`` (default: its name), whose values are
    of ``dtype``: ``int64`` or ``string``. Undeclared (None), a key is an integer or a string; declared,
    ``"3"`` for an int64 key is refused as well (a lookup of it would find no entity, silently)."""

    name: str
    join_keys: Sequence[str] = ()
    dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "join_keys", tuple(self.join_keys) or (self.name,))
        if self.dtype is not None and self.dtype not in KEY_DTYPES:
            raise UsageError(f"bad value dtype={self.dtype!r} of entity {self.name!r}: one of {', '.join(KEY_DTYPES)}")

    def key_error(self, key: str, value: object) -> str | None:
        """Why ``value`` cannot be a value of join key ``key``, or None when it can: the type is checked,
        never converted (``3.0``, ``true`` and ``null`` are not the key 3)."""
        is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        if is_int and not INT64[0] <= int(value) <= INT64[1]:  # type: ignore[call-overload]
            return f"{key}={value} is out of the int64 range of entity {self.name!r}'s keys"
        fits = {"int64": is_int, "string": isinstance(value, str), None: is_int or isinstance(value, str)}
        if fits[self.dtype]:
            return None
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        wanted = {"int64": "an integer", "string": "a string", None: "an integer or a string"}[self.dtype]
        return f"{key}={shown} is {_type_name(value)}, but entity {self.name!r} has {wanted} as its {key!r}"


def _type_name(value: object) -> str:
    """A value's type as a JSON client would name it."""
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return "a boolean"
    if isinstance(value, (float, np.floating)):
        return "a number with a fraction"
    if isinstance(value, (int, np.integer)):
        return "an integer"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class Field:
    """A feature: its name, dtype and, optionally, the skew past which serving alarms for it (the
    Jensen-Shannon divergence or L-infinity distance from its training distribution; default 0.1)."""

    name: str
    dtype: str = "float64"
    skew_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"bad value dtype={self.dtype!r} of feature {self.name!r}: one of {', '.join(DTYPES)}")


def feature_column(values: Sequence[object], dtype: str) -> np.ndarray:
    """A feature's values as a transformation sees them, the same at training and at serving:
    numbers in the field's dtype, a missing value as NaN (integers with one become float64)."""
    missing = [v is None or (isinstance(v, float) and np.isnan(v)) for v in values]
    if dtype in ("string", "bool") and not any(missing):
        return np.array(values, dtype=object if dtype == "string" else bool)
    if dtype in ("string", "bool"):
        return np.array(values, dtype=object)
    if any(missing) and dtype.startswith("int"):
        dtype = "float64"
    return np.array([np.nan if m else v for v, m in zip(values, missing)], dtype=dtype)


@dataclass(frozen=True)
class FileSource:
    """Parquet files (a path, directory or glob) with one row per entity and event time. Rows with the
    same keys and event time are told apart by ``created_timestamp_column`` (the latest wins), else by
    their order in the files (the last wins)."""

    path: str
    timestamp_field: str = "event_timestamp"
    created_timestamp_column: str | None = None


@dataclass(frozen=True)
class FeatureView:
    """Features of ``entities`` from ``source``; a value is valid for ``ttl`` after its event time
    (None: forever). Retrieval at time t takes, per entity, the latest row at or before t."""

    name: str
    entities: Sequence[Entity]
    schema: Sequence[Field]
    source: FileSource
    ttl: timedelta | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "entities", tuple(self.entities))
        object.__setattr__(self, "schema", tuple(self.schema))
        if not self.entities or not self.schema:
            raise UsageError(f"feature view {self.name!r} needs at least one entity and one field")
        if self.ttl is not None and self.ttl < timedelta(0):
            raise UsageError(f"feature view {self.name!r}: ttl must not be negative")

    @property
    def join_keys(self) -> tuple[str, ...]:
        return tuple(key for entity in self.entities for key in entity.join_keys)

    def key_entities(self) -> tuple[tuple[str, Entity], ...]:
        """Each join key, in ``join_keys``' order, and the entity whose ``dtype`` its values must have."""
        return tuple((key, entity) for entity in self.entities for key in entity.join_keys)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.schema)

    def dtype(self, feature: str) -> str:
        return next(f.dtype for f in self.schema if f.name == feature)

    def field(self, feature: str) -> Field:
        return next(f for f in self.schema if f.name == feature)


@dataclass(frozen=True)
class OnDemandFeatureView:
    """``function`` turns the columns of ``sources``' features (numpy arrays, one row per entity row)
    into the columns of ``schema``; the same function runs on a training set and on a served request."""

    name: str
    sources: Sequence[FeatureView]
    schema: Sequence[Field]
    function: Callable[[Columns], Columns] = field(compare=False)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.schema)

    def field(self, feature: str) -> Field:
        return next(f for f in self.schema if f.name == feature)

    def inputs(self, values: Callable[[FeatureView, str], Sequence[object]]) -> Columns:
        """The columns the function takes, from ``values(view, feature)`` of each source feature."""
        return {f: feature_column(values(source, f), source.dtype(f)) for source in self.sources
                for f in source.features}

    def transform(self, columns: Columns) -> Columns:
        out = self.function(columns)
        missing = [name for name in self.features if name not in out]
        if missing:
            raise UsageError(f"on-demand feature view {self.name!r} did not return {', '.join(missing)}")
        return {name: np.asarray(out[name]) for name in self.features}


def on_demand_feature_view(*, sources: Sequence[FeatureView], schema: Sequence[Field],
                           name: str | None = None) -> Callable[[Callable[[Columns], Columns]], OnDemandFeatureView]:
    """Feast's decorator: the function below becomes an on-demand feature view of that name."""

    def wrap(function: Callable[[Columns], Columns]) -> OnDemandFeatureView:
        return OnDemandFeatureView(name or function.__name__, tuple(sources), tuple(schema), function)

    return wrap


@dataclass(frozen=True)
class FeatureService:
    """The features a model uses: whole views, or ``view[["a", "b"]]``-style selections by reference."""

    name: str
    features: Sequence[FeatureView | OnDemandFeatureView]

    def references(self) -> list[str]:
        return [f"{view.name}:{feature}" for view in self.features for feature in view.features]

    def fields(self) -> list[Field]:
        return [view.field(feature) for view in self.features for feature in view.features]


@dataclass
class FeatureRepository:
    """Everything one repository module declares."""

    entities: Sequence[Entity] = ()
    views: Sequence[FeatureView | OnDemandFeatureView] = ()
    services: Sequence[FeatureService] = ()

    def view(self, name: str) -> FeatureView | OnDemandFeatureView:
        for view in self.views:
            if view.name == name:
                return view
        raise UsageError(f"unknown feature view {name!r} (views: {', '.join(v.name for v in self.views)})")

    def service(self, name: str) -> FeatureService:
        for service in self.services:
            if service.name == name:
                return service
        raise UsageError(f"unknown feature service {name!r} (services: "
                         f"{', '.join(s.name for s in self.services) or 'none'})")

    def resolve(self, references: Sequence[str]) -> list[tuple[FeatureView | OnDemandFeatureView, str]]:
        """``view:feature`` references as (view, feature), checked."""
        resolved = []
        for reference in references:
            view_name, sep, feature = reference.partition(":")
            if not sep:
                raise UsageError(f"bad feature reference {reference!r}: expected view:feature")
            view = self.view(view_name)
            if feature not in view.features:
                raise UsageError(f"bad feature reference {reference!r}: view {view_name!r} has "
                                 f"{', '.join(view.features)}")
            resolved.append((view, feature))
        return resolved
