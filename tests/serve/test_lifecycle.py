"""What an orchestrator relies on, over real sockets: shutdown behind a load balancer, liveness when a
model call hangs, 500s that tell the client nothing internal, and each model loaded once."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from mlscale.registry import LocalArtifactStore, Registry
from mlscale.serve.options import ServeOptions
from mlscale.serve.server import build_state
from tests.declared_tasks import FAIL, SLOW
from tests.serve.conftest import infer_body, running_server

DIGITS_ROW = [[0.5] * 64]


def _fresh(method: str, url: str, **kwargs) -> httpx.Response:
    """One request on a new connection, as a load balancer's probe or a new client would send it."""
    with httpx.Client(timeout=5) as client:
        return client.request(method, url, **kwargs)


def test_after_sigterm_ready_is_503_and_inference_is_served_for_the_drain_delay_then_exit_0(serve_registry):
    delay = 6.0
    with running_server(serve_registry, "models:/digits/1", "--drain-delay-s", str(delay)) as (base, process):
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        seen = []
        while time.monotonic() - signalled < delay - 2.0:  # well inside the delay, even on a slow runner
            ready = _fresh("GET", f"{base}/v2/health/ready")
            infer = _fresh("POST", f"{base}/v2/models/digits/infer", json=infer_body(DIGITS_ROW))
            seen.append((ready.status_code, infer.status_code))
            time.sleep(0.2)
        assert process.wait(timeout=delay + 20) == 0
        exited = time.monotonic() - signalled
    assert len(seen) >= 3 and set(seen) == {(503, 200)}, seen
    assert delay - 0.3 <= exited <= delay + 10


def test_a_second_signal_during_the_drain_exits_at_once(serve_registry):
    with running_server(serve_registry, "models:/digits/1", "--drain-delay-s", "60") as (base, process):
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while _fresh("GET", f"{base}/v2/health/ready").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        process.wait(timeout=10)
        assert time.monotonic() - start < 5.0  # not the 60 s of the drain delay


def test_a_model_call_past_the_exec_timeout_marks_the_server_not_live(serve_registry):
    with running_server(serve_registry, "models:/misbehaving/1", "--runtime", "torch", "--exec-timeout-s", "0.5",
                        "--cache-mb", "0") as (base, _):
        assert _fresh("GET", f"{base}/v2/health/live").status_code == 200
        for i in range(5):  # the cost model learns these calls are fast: they would run on the event loop
            httpx.post(f"{base}/v2/models/misbehaving/infer", json=infer_body([[0.1 * i, 0, 0, 0]]))
        answers = []
        slow = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{base}/v2/models/misbehaving/infer", json=infer_body([[SLOW, 0, 0, 0]]), timeout=30)))
        slow.start()
        sent = time.monotonic()
        live = _fresh("GET", f"{base}/v2/health/live")
        while live.status_code == 200 and time.monotonic() - sent < 1.9:  # the call sleeps 2 s
            time.sleep(0.05)
            live = _fresh("GET", f"{base}/v2/health/live")
        assert live.status_code == 503 and "exec-timeout" in live.json()["error"]
        slow.join(timeout=30)
        assert answers[0].status_code == 200
        assert _fresh("GET", f"{base}/v2/health/live").status_code == 503  # stays down: restart is the cure


def test_a_failing_model_call_answers_500_with_a_request_id_and_logs_the_error_under_it(serve_registry):
    with running_server(serve_registry, "models:/misbehaving/1", "--runtime", "torch") as (base, process):
        failed = httpx.post(f"{base}/v2/models/misbehaving/infer", json=infer_body([[FAIL, 0, 0, 0]]))
        ok = httpx.post(f"{base}/v2/models/misbehaving/infer", json=infer_body([[0.1, 0.2, 0.3, 0.4]]))
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        log = process.stderr.read()
    assert failed.status_code == 500 and ok.status_code == 200
    request_id = failed.headers["x-request-id"]
    assert failed.json() == {"error": f"internal error (request id {request_id})"}
    assert "secret" not in failed.text and "RuntimeError" not in failed.text
    assert f"request {request_id}" in log and "secret internal detail" in log


class CountingStore(LocalArtifactStore):
    """The local store, counting how often each artifact is read and hashed."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fetches: Counter[str] = Counter()

    def fetch(self, key: str, sha256: str) -> Path:
        self.fetches[key] += 1
        return super().fetch(key, sha256)

    def fetch_bytes(self, key: str, sha256: str) -> bytes:
        self.fetches[key] += 1
        return super().fetch_bytes(key, sha256)


def test_each_model_is_loaded_and_hashed_once_at_start(serve_registry):
    store = CountingStore(Path(serve_registry) / "artifacts")
    registry = Registry(serve_registry, artifacts=store)
    state = build_state(["models:/digits/2", "models:/slow/1"], ServeOptions(), registry)

    async def start_and_stop() -> None:
        for slot in state.slots:
            await slot.load()
            assert slot.current is not None
            await slot.current.batcher.close()

    asyncio.run(start_and_stop())
    assert dict(store.fetches) == {"digits/2/model.onnx": 1, "slow/1/model.safetensors": 1}
