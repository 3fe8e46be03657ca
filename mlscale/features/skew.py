"""Training-serving skew: how far the feature values a model is served have moved from those it was
trained on, per feature, as TFDV measures it: the Jensen-Shannon divergence (base 2, in [0, 1])
between the training histogram and the served values binned the same way, for numeric features; the
L-infinity distance between category frequencies, for categorical ones.

A feature is skewed past its threshold (default 0.1 for both; per feature in ``thresholds``) once at
least ``min_samples`` served values were seen: with fewer, a histogram's noise alone could cross it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

DEFAULT_THRESHOLD = 0.1
MIN_SAMPLES = 200


def js_divergence(p: Sequence[float], q: Sequence[float]) -> float:
    """Jensen-Shannon divergence of two histograms (counts or frequencies), base 2: 0 equal, 1 disjoint."""
    a, b = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if a.sum() == 0 or b.sum() == 0:
        return 0.0
    a, b = a / a.sum(), b / b.sum()
    m = (a + b) / 2

    def kl(x: np.ndarray) -> float:
        present = x > 0
        return float(np.sum(x[present] * np.log2(x[present] / m[present])))

    return max(0.0, (kl(a) + kl(b)) / 2)


def linf_distance(p: Mapping[str, float], q: Mapping[str, float]) -> float:
    """The largest difference of a category's frequency between two distributions."""
    total_p, total_q = sum(p.values()) or 1.0, sum(q.values()) or 1.0
    return max((abs(p.get(k, 0.0) / total_p - q.get(k, 0.0) / total_q) for k in {*p, *q}), default=0.0)


@dataclass
class FeatureSkew:
    """Served values of each feature, binned as its training histogram; ``report`` compares them."""

    statistics: dict[str, dict[str, Any]]
    thresholds: dict[str, float] = field(default_factory=dict)
    min_samples: int = MIN_SAMPLES
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    categories: dict[str, dict[str, float]] = field(default_factory=dict)
    seen: int = 0

    def __post_init__(self) -> None:
        for name, stats in self.statistics.items():
            if "skew_threshold" in stats:  # declared on the feature's Field; an explicit threshold wins
                self.thresholds.setdefault(name, stats["skew_threshold"])
            if stats.get("kind") == "numeric" and "edges" in stats:
                self.counts[name] = np.zeros(len(stats["counts"]), dtype=np.int64)
            elif stats.get("kind") == "categorical":
                self.categories[name] = {}

    def observe(self, columns: Mapping[str, Sequence[Any]]) -> None:
        """Served values, a column per feature (one row per served vector); a missing value is not counted."""
        rows = 0
        for name, column in columns.items():
            rows = len(column)
            if name in self.counts:
                values = np.array([np.nan if v is None else v for v in column], dtype=np.float64)
                values = values[~np.isnan(values)]
                edges = np.asarray(self.statistics[name]["edges"])
                self.counts[name] += np.bincount(np.searchsorted(edges, values, side="right"),
                                                 minlength=len(self.counts[name]))
            elif name in self.categories:
                for value in column:
                    if value is not None:
                        self.categories[name][str(value)] = self.categories[name].get(str(value), 0.0) + 1
        self.seen += rows

    def distance(self, name: str) -> float:
        if name in self.counts:
            return js_divergence(self.statistics[name]["counts"], self.counts[name])
        return linf_distance(self.statistics[name].get("frequencies", {}), self.categories.get(name, {}))

    def report(self) -> list[dict[str, Any]]:
        """Per feature: its measure, distance, threshold and whether it is skewed (None: too few samples)."""
        rows = []
        for name in [*self.counts, *self.categories]:
            threshold = self.thresholds.get(name, DEFAULT_THRESHOLD)
            distance = self.distance(name)
            rows.append({"feature": name, "measure": "jensen_shannon" if name in self.counts else "l_infinity",
                         "distance": distance, "threshold": threshold, "samples": self.seen,
                         "skewed": None if self.seen < self.min_samples else distance > threshold})
        return rows


class FeatureLog:
    """Served feature vectors, by model version and time, in a SQLite file: what ``mlscale features
    skew`` reads, from another process, while the server goes on."""

    def __init__(self, path: str) -> None:
        self.connection = sqlite3.connect(path, check_same_thread=False, timeout=10)
        with self.connection:
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("CREATE TABLE IF NOT EXISTS served (model TEXT, version INTEGER, at REAL, "
                                    "vector TEXT)")

    def append(self, model: str, version: int, at: float, columns: Mapping[str, Sequence[Any]]) -> None:
        """One row per served vector: its values (None for a missing one), JSON, by feature name."""
        names = list(columns)
        rows = zip(*(columns[n] for n in names))
        with self.connection:
            self.connection.executemany("INSERT INTO served VALUES (?, ?, ?, ?)", [
                (model, version, at, orjson.dumps(dict(zip(names, row)), option=orjson.OPT_SERIALIZE_NUMPY).decode())
                for row in rows])

    def columns(self, model: str, version: int, names: Sequence[str], since: float = 0.0) -> dict[str, list[Any]]:
        rows = [orjson.loads(r[0]) for r in self.connection.execute(
            "SELECT vector FROM served WHERE model = ? AND version = ? AND at >= ?", (model, version, since))]
        return {name: [row.get(name) for row in rows] for name in names}
