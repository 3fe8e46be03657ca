"""``mlscale bench serve`` starts every trial on a drained server: a backlog left by an earlier trial
(the load generator gone, its requests still queued in the server) is waited out first."""

import http.client
import json
import subprocess
import sys
import time

import pytest

from mlscale.bench.serve import Server, _post, _wait_ready, wait_drained
from tests.serve.conftest import infer_body, running_server


def _latency(server: Server) -> float:
    """One request on a fresh keep-alive connection, timed from send to answer (connecting excluded)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.connect()
    start = time.perf_counter()
    assert _post(conn, server, server.bodies[0]) == 200
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


@pytest.mark.alone  # an idle server's latency, against a budget
def test_wait_drained_waits_out_a_backlog(serve_registry):
    body = infer_body([[0.5] * 64])
    with running_server(serve_registry, "models:/slow/1", "--queue-limit", "100000",
                        "--max-batch-size", "4", "--cache-mb", "0") as (base, process):
        port = int(base.rsplit(":", 1)[1])
        server = Server("mlscale", process, port, "/v2/models/slow/infer", [json.dumps(body)])
        _wait_ready(server)  # also times the idle server: median of 20 requests
        assert 0 < server.idle_s < 0.2
        assert wait_drained(server) < 5  # idle: three quick probes
        # Flood the 2048-wide MLP far past what it can do, then kill the generator mid-run: its requests
        # stay queued in the server, which keeps computing them.
        config = {"host": "127.0.0.1", "port": port, "path": "/v2/models/slow/infer", "bodies": [json.dumps(body)],
                  "rate": 4000, "duration_s": 5.0, "warmup_s": 0.0, "connections": 64}
        flood = subprocess.Popen([sys.executable, "-m", "mlscale.bench.loadgen", json.dumps(config)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.0)
        flood.kill()
        flood.wait(timeout=10)
        waited = wait_drained(server, timeout=120)  # raises if never drained
        assert 0.3 < waited < 120  # there was a backlog, and it was waited out
        # Drained: answered in a blink, not behind seconds of backlog (8,000 requests at ~0.4 ms each).
        assert _latency(server) < 0.25
