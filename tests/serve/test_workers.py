"""``mlscale serve --workers N``: processes sharing the ports, a whole-server readiness and /metrics,
hot reload followed by every worker, a worker killed under load restarted with nothing lost but what
it held, and a drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlscale.registry import Registry
from tests.serve.conftest import infer_body, metric, running_server


def _workers_of(supervisor_pid: int) -> list[int]:
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def _eventually(check, timeout: float = 15.0):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value or time.time() > deadline:
            return value
        time.sleep(0.1)


def _counted_success(base: str) -> float:
    return metric(base, "mlscale_inference_request_success_total", model="digits", version="1")


@pytest.mark.timeout(180)
def test_a_worker_killed_under_load_is_restarted_and_only_its_own_requests_fail(serve_registry):
    Registry(serve_registry).set_alias("digits", 1, "production")
    with running_server(serve_registry, "models:/digits@production", "--workers", "2", "--cache-mb", "1",
                        "--reload-interval-s", "0.3") as (base, server):
        workers = _workers_of(server.pid)
        assert len(workers) == 2
        # one server, seen whole from either worker: both workers' gauges, the cache's bound for both
        assert metric(base, "mlscale_model_loaded", model="digits", version="1", worker="0") == 1
        assert metric(base, "mlscale_model_loaded", model="digits", version="1", worker="1") == 1
        assert metric(base, "mlscale_cache_max_bytes") == 1024 * 1024
        assert metric(base, "mlscale_workers", state="ready") == 2

        rng = np.random.default_rng(0)
        answered, failed, stop = [], [], threading.Event()
        clients = 6

        def load():
            while not stop.is_set():  # a new connection per request: each is handed to either worker
                try:
                    response = httpx.post(f"{base}/v2/models/digits/infer", timeout=10,
                                          json=infer_body(rng.random((1, 64)).tolist()))
                    (answered if response.status_code == 200 else failed).append(response.status_code)
                except httpx.TransportError as exc:  # the connection the killed worker held
                    failed.append(type(exc).__name__)

        threads = [threading.Thread(target=load) for _ in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        os.kill(workers[0], signal.SIGKILL)
        saw_unready = _eventually(lambda: httpx.get(f"{base}/v2/health/ready").status_code == 503, 5)
        time.sleep(1.0)
        before_restart = len(answered)
        assert _eventually(lambda: httpx.get(f"{base}/v2/health/ready").status_code == 200, 60)
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join()

        assert saw_unready, "readiness stayed 200 with a worker down"
        assert len(failed) <= clients, failed  # at most one request in flight per client, on the dead worker
        assert len(answered) > before_restart > 0  # the other worker served meanwhile, and both after
        assert metric(base, "mlscale_worker_restarts_total") == 1
        new_workers = _workers_of(server.pid)
        assert len(new_workers) == 2 and workers[0] not in new_workers and workers[1] in new_workers
        # the whole server's count: everything answered, less at most what the dead worker did in its
        # last half second before it was killed (published every 0.5 s)
        counted = _eventually(lambda: _counted_success(base) >= len(answered) - 500, 5) and _counted_success(base)
        assert len(answered) - 500 <= counted <= len(answered) + 10  # + the two gauge probes' none

        # a hot reload is followed by every worker
        Registry(serve_registry).set_alias("digits", 2, "production")
        both = _eventually(lambda: all(metric(base, "mlscale_model_loaded", model="digits", version="2",
                                              worker=str(w)) == 1 for w in (0, 1)), 20)
        Registry(serve_registry).set_alias("digits", 1, "production")
        assert both
        versions = {httpx.post(f"{base}/v2/models/digits/infer", json=infer_body(rng.random((1, 64)).tolist())
                               ).json()["model_version"] for _ in range(20)}
        assert versions <= {"1", "2"}

        # SIGTERM: every worker drains and goes, the supervisor exits 0
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in new_workers)


def test_grpc_is_served_by_every_worker_on_one_port_and_a_route_key_sticks_across_them(serve_registry):
    import tritonclient.grpc as grpcclient

    from mlscale.serve.share import SHARE_TAG

    registry = Registry(serve_registry)
    registry.set_tag("digits", None, SHARE_TAG, "50")  # what the canary's flag says, whatever ran before
    try:
        with running_server(serve_registry, "models:/digits/1", "--workers", "2", "--canary",
                            "models:/digits/2=50") as (base, server):
            rows = np.random.default_rng(1).random((3, 64)).astype(np.float32)
            for _ in range(6):  # a new channel each time: the kernel spreads them over the workers
                client = grpcclient.InferenceServerClient(server.grpc_address)
                tensor = grpcclient.InferInput("input", list(rows.shape), "FP32")
                tensor.set_data_from_numpy(rows)
                result = client.infer("digits", [tensor])
                assert result.as_numpy("output").shape == (3, 10)
                assert client.is_server_ready()
                client.close()
            # the route-key hash's secret is the server's, shared by its workers: a key meets one version
            # whichever worker takes its connection (a new one per request)
            for key in (f"key-{i}" for i in range(8)):
                versions = {httpx.post(f"{base}/v2/models/digits/infer", headers={"x-route-key": key},
                                       json=infer_body(rows[:1].tolist())).json()["model_version"] for _ in range(5)}
                assert len(versions) == 1, (key, versions)
    finally:
        registry.set_tag("digits", None, SHARE_TAG, "10")  # as the rollout tests leave it


def test_a_bad_worker_count_is_one_line(serve_registry):
    from tests.helpers import refused

    for value, says in (("0", "workers 0 must be at least 1"), ("many", "not a number of workers")):
        result = refused("serve", "models:/digits/1", "--workers", value, "--registry", serve_registry)
        assert result.returncode == 2 and says in result.stderr, result.stderr
