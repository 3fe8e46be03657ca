"""bench features runs end to end at a small size and its retrieval equals the pandas reference."""

from __future__ import annotations

import argparse

import pytest

from mlscale.bench.features import run_benchmark
from tests.features.conftest import REDIS_URL, redis_prefix  # noqa: F401  (the fixture: Redis is up)


@pytest.mark.usefixtures("redis_prefix")
def test_the_features_benchmark_runs_and_agrees_with_pandas():
    args = argparse.Namespace(entity_rows=5000, keys=500, source_rows=2000, repeats=1, lookups=100, redis=REDIS_URL)
    results = run_benchmark(args)
    assert results["same_result"] is True
    assert set(results["lookups"]) == {"sqlite", "redis"} and results["lookups"]["sqlite"]["lookups"] == 100
    assert results["served_latency"]["features"]["requests"] == 1000
