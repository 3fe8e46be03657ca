"""Skew measures: Jensen-Shannon for numeric features against the training histogram, L-infinity for
categorical ones; shifted serving data is flagged, data from the training distribution is not."""

from __future__ import annotations

import numpy as np
import pytest

from mlscale.features.skew import FeatureSkew, js_divergence, linf_distance
from mlscale.tasks.featured import numeric_statistics


def _skew(seed: int, shift: float, served: int = 500) -> dict:
    rng = np.random.default_rng(seed)
    statistics = {"x": numeric_statistics(rng.normal(0, 1, 2000))}
    skew = FeatureSkew(statistics)
    skew.observe({"x": rng.normal(shift, 1, served)})
    return skew.report()[0]


def test_the_measures():
    assert js_divergence([1, 1], [1, 1]) == 0.0
    assert js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    assert linf_distance({"a": 3, "b": 1}, {"a": 1, "b": 1}) == pytest.approx(0.25)


def test_shifted_serving_data_is_flagged():
    row = _skew(seed=0, shift=1.0)
    assert row["measure"] == "jensen_shannon" and row["skewed"] and row["distance"] > 0.1


def test_no_false_alarm_over_20_seeds_at_the_default_threshold():
    rows = [_skew(seed, shift=0.0) for seed in range(20)]
    assert not any(row["skewed"] for row in rows)
    assert max(row["distance"] for row in rows) < 0.05


def test_a_threshold_declared_on_the_field_applies_and_an_explicit_one_wins():
    rng = np.random.default_rng(4)
    statistics = {"x": {**numeric_statistics(rng.normal(0, 1, 2000)), "skew_threshold": 0.9}}
    served = {"x": rng.normal(1, 1, 500)}
    declared = FeatureSkew(statistics)
    declared.observe(served)
    assert declared.report()[0]["threshold"] == 0.9 and not declared.report()[0]["skewed"]
    explicit = FeatureSkew(statistics, thresholds={"x": 0.1})
    explicit.observe(served)
    assert explicit.report()[0]["skewed"]


def test_too_few_samples_decide_nothing_and_missing_values_are_not_binned():
    row = _skew(seed=1, shift=3.0, served=50)
    assert row["skewed"] is None and row["samples"] == 50
    skew = FeatureSkew({"x": numeric_statistics(np.arange(100.0))})
    skew.observe({"x": [None, np.nan, 5.0]})
    assert skew.counts["x"].sum() == 1


def test_a_categorical_feature_is_measured_by_l_infinity():
    from mlscale.tasks.featured import categorical_statistics

    rng = np.random.default_rng(5)
    tiers = ["free", "pro", "team"]
    statistics = {"tier": categorical_statistics(list(rng.choice(tiers, 2000, p=[0.6, 0.3, 0.1])))}
    same, moved = FeatureSkew(statistics), FeatureSkew(statistics)
    same.observe({"tier": list(rng.choice(tiers, 500, p=[0.6, 0.3, 0.1]))})
    moved.observe({"tier": list(rng.choice(tiers, 500, p=[0.2, 0.3, 0.5]))})
    assert same.report()[0]["measure"] == "l_infinity" and not same.report()[0]["skewed"]
    assert moved.report()[0]["skewed"] and moved.report()[0]["distance"] == pytest.approx(0.4, abs=0.06)
