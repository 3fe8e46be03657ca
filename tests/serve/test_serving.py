"""Server behaviour over real sockets: coalesced cache misses, backpressure, hot reload under load,
graceful shutdown."""

import asyncio
import signal
import threading
import time

import httpx
import numpy as np

from mlscale.registry import Registry, load_torch_model
from tests.serve.conftest import infer_body, metric, running_server


async def _post_many(url, bodies, limit=200):
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        return await asyncio.gather(*(client.post(url, json=b) for b in bodies))


def test_100_concurrent_identical_requests_run_the_model_once(serve_registry):
    with running_server(serve_registry, "models:/digits/2") as (base, _):
        labels = {"model": "digits", "version": "2"}
        before = metric(base, "mlscale_inference_exec_count_total", **labels)
        body = infer_body([[0.125] * 64])
        responses = asyncio.run(_post_many(f"{base}/v2/models/digits/infer", [body] * 100))
        assert all(r.status_code == 200 for r in responses)
        assert len({r.text for r in responses}) == 1
        assert metric(base, "mlscale_inference_exec_count_total", **labels) - before == 1
        hits = metric(base, "mlscale_cache_num_hits_per_model_total", **labels)
        coalesced = metric(base, "mlscale_cache_num_coalesced_per_model_total", **labels)
        assert hits + coalesced == 99
        # the same numbers written differently are the same cache entry
        again = httpx.post(f"{base}/v2/models/digits/infer", content=httpx.Request(
            "POST", "/", json=body).content.replace(b"0.125", b"1.25e-1"), headers={"content-type": "application/json"})
        assert again.status_code == 200 and metric(base, "mlscale_cache_num_hits_per_model_total", **labels) == hits + 1


def test_a_full_queue_answers_503_with_retry_after_and_admitted_requests_succeed(serve_registry):
    with running_server(serve_registry, "models:/slow/1", "--queue-limit", "2", "--max-batch-size", "1",
                        "--cache-mb", "0") as (base, _):
        bodies = [infer_body([[float(i)] * 64]) for i in range(60)]
        responses = asyncio.run(_post_many(f"{base}/v2/models/slow/infer", bodies))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= 2
        refused = [r for r in responses if r.status_code == 503]
        assert all(r.headers["retry-after"] == "1" and "overloaded" in r.json()["error"] for r in refused)
        assert metric(base, "mlscale_inference_request_failure_total", model="slow", version="1",
                      reason="overloaded") == codes.count(503)


def test_moving_the_alias_swaps_versions_under_load_without_a_failed_request(serve_registry):
    registry = Registry(serve_registry)
    registry.set_alias("digits", 1, "production")
    rng = np.random.default_rng(1)
    with running_server(serve_registry, "models:/digits@production", "--reload-interval-s", "0.2",
                        "--cache-mb", "0") as (base, _):
        seen, failures, stop = [], [], threading.Event()

        def load():
            with httpx.Client(timeout=10) as client:
                while not stop.is_set():
                    r = client.post(f"{base}/v2/models/digits/infer", json=infer_body(rng.random((2, 64)).tolist()))
                    (seen if r.status_code == 200 else failures).append(
                        r.json()["model_version"] if r.status_code == 200 else r.text)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        registry.set_alias("digits", 2, "production")
        deadline = time.time() + 15
        while time.time() < deadline and (not seen or seen[-1] != "2"):
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        registry.set_alias("digits", 1, "production")
    assert failures == []
    assert "1" in seen and seen[-1] == "2"
    first_new = seen.index("2")
    assert seen[first_new:].count("1") <= 4  # at most the requests already queued on the old version


def _received(base: str, model: str) -> float:
    """The requests for ``model`` version 1 that the server holds or has answered (max batch size 1)."""
    return sum(metric(base, name, model=model, version="1") for name in (
        "mlscale_inference_request_success_total", "mlscale_inference_pending_request_count",
        "mlscale_inference_executing"))


def test_sigterm_lets_in_flight_requests_finish(serve_registry):
    with running_server(serve_registry, "models:/slow/1", "--max-batch-size", "1", "--cache-mb", "0",
                        "--queue-limit", "100") as (base, process):
        async def scenario():
            limits = httpx.Limits(max_connections=50)
            async with httpx.AsyncClient(limits=limits, timeout=30) as client:
                tasks = [asyncio.ensure_future(client.post(f"{base}/v2/models/slow/infer",
                                                           json=infer_body([[float(i)] * 64])))
                         for i in range(30)]
                # all received (however long a busy host takes to send them), most still queued
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(_received, base, "slow") < len(tasks) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                process.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(scenario())
        assert all(not isinstance(r, Exception) and r.status_code == 200 for r in results), results
        # a drained shutdown is a clean exit
        assert process.wait(timeout=30) == 0


def test_after_a_version_change_the_cache_never_answers_with_the_old_version(serve_registry):
    registry = Registry(serve_registry)
    registry.set_alias("digits", 1, "production")
    body = infer_body([[0.5] * 64])
    try:
        with running_server(serve_registry, "models:/digits@production", "--reload-interval-s", "0.2") as (base, _):
            url = f"{base}/v2/models/digits/infer"
            old = [httpx.post(url, json=body).json() for _ in range(3)]  # a miss, then hits
            assert {r["model_version"] for r in old} == {"1"}
            registry.set_alias("digits", 2, "production")
            deadline = time.time() + 15
            new = httpx.post(url, json=body).json()
            while new["model_version"] != "2" and time.time() < deadline:
                time.sleep(0.1)
                new = httpx.post(url, json=body).json()
            assert new["model_version"] == "2"
            assert new["outputs"][0]["data"] != old[0]["outputs"][0]["data"]
            assert metric(base, "mlscale_cache_num_misses_per_model_total", model="digits", version="2") == 1
    finally:
        registry.set_alias("digits", 1, "production")


def test_on_one_core_batches_run_inline_and_every_concurrent_request_gets_its_own_answer(serve_registry):
    """Pinned to one core (and without an SLO) the server runs every batch on its event loop."""
    rng = np.random.default_rng(3)
    rows = rng.random((60, 64), dtype=np.float32)
    with running_server(serve_registry, "models:/slow/1", "models:/digits/1", "--cache-mb", "0",
                        "--max-delay-ms", "20", cpus={0}) as (base, _):
        slow = asyncio.run(_post_many(f"{base}/v2/models/slow/infer", [infer_body([r.tolist()]) for r in rows]))
        digits = asyncio.run(_post_many(f"{base}/v2/models/digits/infer", [infer_body([r.tolist()]) for r in rows]))
        singles = [httpx.post(f"{base}/v2/models/slow/infer", json=infer_body([r.tolist()])) for r in rows[:3]]
        batches = metric(base, "mlscale_inference_exec_count_total", model="slow", version="1")
    for responses in (slow, digits, singles):
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    registry = Registry(serve_registry)
    import torch

    model = load_torch_model(registry, registry.get_version("slow", 1))
    expected = model(torch.from_numpy(rows)).detach().numpy()
    got = np.array([r.json()["outputs"][0]["data"] for r in slow])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert batches < 60 + 3  # the 60 concurrent requests shared batches


def test_a_server_of_onnx_models_never_loads_torch(serve_registry):
    """Serving an ONNX model needs onnxruntime, not torch: start-up in a fraction of the time and a
    smaller process (torch's libraries are most of a server's memory otherwise)."""
    with running_server(serve_registry, "models:/digits@production") as (base, process):
        assert httpx.post(f"{base}/v2/models/digits/infer", json=infer_body([[0.5] * 64])).status_code == 200
        with open(f"/proc/{process.pid}/maps") as maps:
            libraries = maps.read()
    assert "onnxruntime" in libraries
    assert "libtorch" not in libraries
