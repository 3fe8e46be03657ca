"""The open-loop load generator against a real server: counts, statuses, latency from intended send time."""

import json
import subprocess
import sys

import pytest

from tests.serve.conftest import infer_body, running_server


def test_loadgen_measures_a_real_server(serve_registry):
    with running_server(serve_registry, "models:/digits/1") as (base, _):
        port = int(base.rsplit(":", 1)[1])
        config = {"host": "127.0.0.1", "port": port, "path": "/v2/models/digits/infer",
                  "bodies": [json.dumps(infer_body([[0.1 * i] * 64])) for i in range(5)] + ["{bad json"],
                  "rate": 120, "duration_s": 1.0, "warmup_s": 0.3, "connections": 4, "timeline": True}
        output = subprocess.run([sys.executable, "-m", "mlscale.bench.loadgen", json.dumps(config)],
                                capture_output=True, text=True, timeout=60)
        assert output.returncode == 0, output.stderr
        result = json.loads(output.stdout)
    assert 60 <= result["requests"] <= 200  # Poisson around 120/s for 1 s
    assert set(result["statuses"]) == {"200", "400"}  # one body in six is malformed
    assert 0.05 < result["error_rate"] < 0.35
    assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"] < 1000
    timeline = result["timeline"]  # (intended send time, latency) of every answered request
    assert len(timeline) == result["ok"]
    assert all(0.3 <= sent < 1.3 and latency > 0 for sent, latency in timeline)
    assert max(latency for _, latency in timeline) == round(result["latency_ms"]["max"], 3)


@pytest.mark.alone  # the generator's lag and every answer in time, against budgets
def test_a_full_pool_makes_requests_wait_without_opening_connections(serve_registry):
    """Past ``max_connections`` a request waits for a free connection: the generator stays on time
    (its lag is small) and the wait shows as latency, counted from the intended send time."""
    body = json.dumps(infer_body([[0.5] * 64]))
    with running_server(serve_registry, "models:/slow/1", "--cache-mb", "0", "--max-batch-size", "1") as (base, _):
        port = int(base.rsplit(":", 1)[1])
        config = {"host": "127.0.0.1", "port": port, "path": "/v2/models/slow/infer", "bodies": [body],
                  "rate": 1000, "duration_s": 1.0, "warmup_s": 0.2, "connections": 2, "max_connections": 2}
        output = subprocess.run([sys.executable, "-m", "mlscale.bench.loadgen", json.dumps(config)],
                                capture_output=True, text=True, timeout=120)
        assert output.returncode == 0, output.stderr
        result = json.loads(output.stdout)
    assert result["connections_opened"] == 2
    assert result["waited_for_connection"] > 0
    assert result["statuses"] == {"200": result["requests"]}  # every request answered, none dropped
    assert result["generator_lag_ms"]["p99"] < 50
    # 1,000 requests/s to a model that takes >= 1 ms each, two at a time: the queue builds in the
    # client and its wait is latency (the server alone answers one in a few ms).
    assert result["latency_ms"]["p99"] > 100
