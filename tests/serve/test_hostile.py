"""Hostile clients, on real sockets (127.0.0.1 only, bounded in count and time): while each attack runs,
a normal client on its own connection keeps its p99 under 100 ms and is never refused, the server's
memory stays bounded, and the server answers at once when the attack stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from mlscale import TrainConfig, fit
from mlscale.bench.hostile import Target, measure, nested_zeros_body
from mlscale.registry import Registry, register_run
from tests.features.test_serving import trained  # noqa: F401  (a fixture: a model trained from features)
from tests.serve.conftest import infer_body, metric, running_server

P99_MS = 100  # what the normal client may see, at most, under any attack here
ATTACK_S = 2.5
LIMITS = ("--read-timeout-s", "1", "--header-timeout-s", "1", "--keep-alive-s", "2", "--max-inflight-mb", "32")


@pytest.fixture(scope="module")
def server(serve_registry):
    """digits, with an SLO (admission control on) and short deadlines so the attacks resolve quickly."""
    with running_server(serve_registry, "models:/digits/1", "--slo-ms", "50", *LIMITS) as (base, process):
        port = int(base.rsplit(":", 1)[1])
        body = json.dumps(infer_body([[0.25] * 64])).encode()
        yield Target(port, body, grpc_address=process.grpc_address, pid=process.pid), base


def _held_to(trial: dict, p99_ms: float = P99_MS) -> None:
    assert trial["client_requests"] > 20, trial
    assert trial["client_errors"] == 0, trial  # never refused, never failed
    assert trial["client_p99_ms"] < p99_ms, trial
    assert trial["answered_again_after_ms"] is not None and trial["answered_again_after_ms"] < 200, trial


@pytest.mark.alone  # the normal client's p99
def test_slow_headers_are_cut_off_at_the_header_deadline(server):
    target, _ = server
    trial = measure(target, "slow_headers", ATTACK_S, clients=50, every_s=0.3)
    _held_to(trial)
    details = trial["details"]
    assert details["connected"] == 50 and details["closed_by_server"] == 50, details
    assert details["answered_408"] == 50, details  # a request had begun: its client is told why


@pytest.mark.alone  # the normal client's p99
def test_slow_bodies_take_no_admission_slot_and_get_408(server):
    target, base = server
    trial = measure(target, "slow_bodies", ATTACK_S, clients=256)
    _held_to(trial)  # with 256 unfinished bodies, the normal client is never refused (no 503)
    details = trial["details"]
    assert details["answered_408"] == details["connected"] == 256, details
    assert metric(base, "mlscale_http_request_refused_total", reason="read_timeout") >= 256


@pytest.mark.alone  # the normal client's p99
def test_idle_connections_are_closed(server):
    target, _ = server
    trial = measure(target, "idle_connections", ATTACK_S, clients=400)
    _held_to(trial)
    assert trial["details"]["closed_by_server"] == trial["details"]["connected"] == 400, trial


@pytest.mark.alone  # the normal client's p99
def test_a_flood_of_almost_whole_bodies_is_bounded_by_the_body_budget(server):
    target, base = server
    trial = measure(target, "body_flood", ATTACK_S, clients=40)
    _held_to(trial, p99_ms=250)  # the server receives ~300 MB on the same 2 cores meanwhile
    # 40 x 8 MB were sent; the server held at most --max-inflight-mb 32 of them (plus its buffers)
    assert trial["rss_peak_mb"] - trial["rss_idle_mb"] < 32 + 48, trial
    assert metric(base, "mlscale_http_request_refused_total", reason="body_budget") >= 30
    assert metric(base, "mlscale_request_body_bytes") == 0  # every byte given back


@pytest.mark.alone  # the normal client's p99
def test_huge_json_bodies_are_refused_before_decoding(server):
    target, base = server
    trial = measure(target, "big_decodes", ATTACK_S, clients=3)
    _held_to(trial)
    assert set(trial["details"]["answers"]) == {"400"}, trial
    refused = httpx.post(f"{base}/v2/models/digits/infer", content=nested_zeros_body(1_000_000))
    assert refused.status_code == 400 and "more values or lists" in refused.json()["error"]


@pytest.mark.alone  # the normal client's p99
def test_grpc_calls_whose_message_never_comes_hold_nothing(server):
    import tritonclient.grpc as grpcclient

    target, _ = server
    trial = measure(target, "grpc_unfinished", ATTACK_S, calls=50)
    _held_to(trial)
    client = grpcclient.InferenceServerClient(target.grpc_address)
    tensor = grpcclient.InferInput("input", [1, 64], "FP32")
    tensor.set_data_from_numpy(np.full((1, 64), 0.25, dtype=np.float32))
    assert client.infer("digits", [tensor]).as_numpy("output").shape == (1, 10)


def test_a_body_over_the_limit_or_past_the_budget_is_refused_and_the_connection_closed(server):
    target, base = server
    with socket.create_connection(("127.0.0.1", target.port)) as sock:
        sock.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n")
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()
    assert httpx.get(f"{base}/v2/health/live").status_code == 200


@pytest.mark.alone  # a deadline, measured
def test_a_body_nobody_reads_is_cut_off_a_second_after_the_read_deadline(server):
    target, _ = server
    with socket.create_connection(("127.0.0.1", target.port)) as sock:
        sock.sendall(b"POST /v2/models/nope/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n{")
        assert sock.recv(4096).startswith(b"HTTP/1.1 404")  # answered before its body arrived
        start, closed = time.monotonic(), False
        sock.settimeout(0.3)
        while time.monotonic() - start < 5 and not closed:  # the client trickles the rest of the body
            try:
                sock.sendall(b"0")
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and time.monotonic() - start < 3  # --read-timeout-s 1, + 1 s


@pytest.mark.alone  # the normal client's p99
def test_48_mb_headers_are_refused_at_their_first_64_kb_while_the_normal_client_is_served(server):
    """httptools took a 48 MB header whole (its parser has no bound): the health probes stalled 2 s."""
    target, _ = server
    trial = measure(target, "big_headers", ATTACK_S, clients=4)
    _held_to(trial)
    assert trial["details"]["closed_by_server"] == trial["details"]["connected"] == 4, trial
    assert trial["rss_peak_mb"] - trial["rss_idle_mb"] < 32, trial  # was 48 MB a connection, and more


def test_one_header_or_all_headers_past_their_bound_are_431(server):
    _, base = server
    assert httpx.get(f"{base}/v2/health/ready", headers={"x-one": "a" * 20_000}).status_code == 431
    assert httpx.get(f"{base}/v2/health/ready", headers={f"x-{i}": "a" * 9_000 for i in range(8)}).status_code == 431
    assert httpx.get(f"{base}/v2/health/ready", headers={"x-fine": "a" * 8_000}).status_code == 200


def test_bad_requests_by_the_hundred_log_a_line_with_a_count_not_a_line_each(serve_registry):
    """A NUL in a header made uvicorn log "Invalid HTTP request received." once per request."""
    with running_server(serve_registry, "models:/digits/1", "--no-grpc") as (base, process):
        port = int(base.rsplit(":", 1)[1])
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nx-bad: a\x00b\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 400")
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert 1 <= stderr.count("Invalid HTTP request received.") <= 2, stderr[-2000:]


def test_declaring_large_bodies_and_sending_nothing_holds_no_budget(server):
    target, base = server
    sockets = [socket.create_connection(("127.0.0.1", target.port)) for _ in range(6)]
    try:
        for sock in sockets:  # 6 x 8 MB declared, past --max-inflight-mb 32, and not a byte of it sent
            sock.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 8000000\r\n\r\n")
        time.sleep(0.2)
        assert httpx.post(f"{base}/v2/models/digits/infer", json=infer_body([[0.5] * 64] * 2000)).status_code == 200
    finally:
        for sock in sockets:
            sock.close()


def test_past_max_connections_a_new_connection_gets_503_and_the_open_ones_are_served(serve_registry):
    with running_server(serve_registry, "models:/digits/1", "--max-connections", "20", "--no-grpc") as (base, _):
        with httpx.Client(base_url=base) as client:  # a keep-alive connection opened before the crowd
            assert client.post("/v2/models/digits/infer", json=infer_body([[0.5] * 64])).status_code == 200
            crowd = [socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) for _ in range(30)]
            try:
                refused = 0
                for sock in crowd:
                    sock.settimeout(0.5)
                    with contextlib.suppress(TimeoutError):  # a timeout: admitted, waiting for its headers
                        refused += sock.recv(4096).startswith(b"HTTP/1.1 503")
                assert refused == 11  # 20 connections at most: the probe's and 19 of the crowd's
                assert client.post("/v2/models/digits/infer", json=infer_body([[0.5] * 64])).status_code == 200
            finally:
                for sock in crowd:
                    sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{base}/v2/health/live").status_code == 200  # room again once they left
        assert metric(base, "mlscale_http_request_refused_total", reason="connections") == 11


# -- integer inputs --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tinylm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinylm")
    fit(TrainConfig(task="tinylm", steps=2, batch_size=4, run_dir=str(root / "run")))
    registry = str(root / "registry")
    version = register_run(Registry(registry), root / "run", "tinylm")
    assert version.signature["inputs"][0]["range"] == [0, 28]  # the 29-symbol vocabulary, recorded
    with running_server(registry, "models:/tinylm/1", "--runtime", "torch", "--cache-mb", "0",
                        "--max-delay-ms", "20") as (base, process):
        yield base, process


def _ids(values: list) -> dict:
    row = [1] * 32
    row[: len(values)] = values
    return {"inputs": [{"name": "input", "shape": [1, 32], "datatype": "INT64", "data": row}]}


@pytest.mark.parametrize(("value", "says"), [(-1, "outside the 0..28"), (29, "outside the 0..28"),
                                             (1e30, "outside the range of INT64"), (1.7, "not whole numbers")])
def test_bad_token_ids_are_a_400_naming_the_input(tinylm, value, says):
    base, _ = tinylm
    answer = httpx.post(f"{base}/v2/models/tinylm/infer", json=_ids([value]))
    assert answer.status_code == 400 and "input 'input'" in answer.json()["error"] and says in answer.json()["error"]


def test_bad_ids_in_binary_data_from_tritonclient_are_a_400(tinylm):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    base, _ = tinylm
    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    tensor = httpclient.InferInput("input", [1, 32], "INT64")
    tensor.set_data_from_numpy(np.full((1, 32), 29, dtype=np.int64))  # binary data, tritonclient's default
    with pytest.raises(InferenceServerException, match=r"outside the 0\.\.28"):
        client.infer("tinylm", [tensor])
    tensor.set_data_from_numpy(np.full((1, 32), 3, dtype=np.int64))
    assert client.infer("tinylm", [tensor]).as_numpy("output").shape == (1, 32, 29)


def test_a_bad_request_never_reaches_the_model_nor_makes_its_batch_mates_rerun(tinylm):
    base, _ = tinylm
    before = metric(base, "mlscale_inference_exec_count_total", model="tinylm", version="1")

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            bodies = [_ids([i % 29]) if i % 2 else _ids([29]) for i in range(40)]
            answers = await asyncio.gather(*(client.post("/v2/models/tinylm/infer", json=b) for b in bodies))
            return [a.status_code for a in answers]

    statuses = asyncio.run(burst())
    assert statuses.count(200) == 20 and statuses.count(400) == 20
    executions = metric(base, "mlscale_inference_exec_count_total", model="tinylm", version="1") - before
    assert 1 <= executions <= 20  # batched or not, never re-run one by one
    assert metric(base, "mlscale_inference_request_failure_total", model="tinylm", version="1", reason="model") == 0


# -- stores that hang ------------------------------------------------------------------------------

def _feature_model_beside_digits(registry: str, tmp_path) -> None:
    fit(TrainConfig(task="digits", steps=5, run_dir=str(tmp_path / "digits")))
    register_run(Registry(registry), tmp_path / "digits", "digits")


def _within(seconds: float, read: Callable[[], float]) -> float:
    """``read()`` again until it is above 0 or ``seconds`` pass; its last value."""
    deadline = time.monotonic() + seconds
    while (value := read()) <= 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _entities_loop(base: str, seconds: float, out: list[tuple[int, float]]) -> None:
    end = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=10) as client:
        while time.monotonic() < end:
            start = time.perf_counter()
            answer = client.post("/v2/models/churn/infer", json={"parameters": {"entities": [{"user_id": 3}]}})
            out.append((answer.status_code, time.perf_counter() - start))
            time.sleep(0.02)


@pytest.mark.alone  # the normal client's p99
def test_a_locked_feature_log_and_a_silent_redis_slow_nothing_else(trained, tmp_path):  # noqa: F811
    registry, _, _, store = trained
    _feature_model_beside_digits(registry, tmp_path)
    feature_log = tmp_path / "served.db"
    body = json.dumps(infer_body([[0.25] * 64])).encode()
    # 1. the feature log locked by another process: inference goes on, the failed writes are counted
    with running_server(registry, "models:/churn/1", "models:/digits/1", "--online-store", str(store),
                        "--feature-log", str(feature_log), "--runtime", "torch", "--cache-mb", "0") as (base, process):
        port = int(base.rsplit(":", 1)[1])
        assert httpx.post(f"{base}/v2/models/churn/infer",
                          json={"parameters": {"entities": [{"user_id": 3}]}}).status_code == 200
        locker = sqlite3.connect(feature_log, timeout=5)
        locker.execute("BEGIN EXCLUSIVE")  # held for the whole attack
        churn: list[tuple[int, float]] = []
        feeder = threading.Thread(target=_entities_loop, args=(base, ATTACK_S, churn))
        feeder.start()
        trial = measure(Target(port, body, pid=process.pid), "idle_connections", ATTACK_S, clients=1)
        feeder.join()
        # the writer's thread fails a write once its busy timeout (1 s) passes: wait for that event, the
        # lock still held, rather than for a time the 2 busy cores may not give it
        failed = _within(30, lambda: metric(base, "mlscale_feature_log_failure_total", model="churn", version="1"))
        locker.rollback()
        _held_to(trial)
        assert churn and all(status == 200 for status, _ in churn), churn[:5]
        assert np.percentile([s for _, s in churn], 99) < P99_MS / 1e3
        assert failed >= 1
        assert httpx.get(f"{base}/v2/health/live", timeout=1).status_code == 200
    # 2. an online Redis that accepts and never answers: 503 with Retry-After at the store timeout, only
    # for the model that needs it; liveness and digits stay fast
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        with running_server(registry, "models:/churn/1", "models:/digits/1", "--online-store",
                            f"redis://127.0.0.1:{silent.getsockname()[1]}/0", "--store-timeout-ms", "200",
                            "--runtime", "torch", "--cache-mb", "0") as (base, process):
            port = int(base.rsplit(":", 1)[1])
            churn = []
            feeder = threading.Thread(target=_entities_loop, args=(base, ATTACK_S, churn))
            feeder.start()
            trial = measure(Target(port, body, pid=process.pid), "idle_connections", ATTACK_S, clients=1)
            feeder.join()
            _held_to(trial)
            assert churn and {status for status, _ in churn} == {503}, churn[:5]
            assert max(s for _, s in churn) < 1.0  # the store timeout, not redis-py's wait for ever
            refused = httpx.post(f"{base}/v2/models/churn/infer", json={"parameters": {"entities": [{"user_id": 3}]}})
            assert refused.headers["retry-after"] == "1" and "online store" in refused.json()["error"]
    finally:
        silent.close()
