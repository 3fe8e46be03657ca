"""The protocol's own clients at their defaults: tritonclient over HTTP (binary tensors) and gRPC, the
binary framing's failure cases (by hand and fuzzed over a real socket), the calls Triton clients make
(model config, statistics, repository index), and gRPC's status codes, metrics and drain."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.declared_tasks import SLOW
from tests.helpers import REPO
from tests.serve.conftest import free_port, infer_body, metric, running_server


@pytest.fixture(scope="module")
def server(serve_registry):
    with running_server(serve_registry, "models:/digits/1", "models:/misbehaving/1") as (base, process):
        yield base, process.grpc_address


def _json_output(base: str, rows: np.ndarray) -> np.ndarray:
    answer = httpx.post(f"{base}/v2/models/digits/infer", json=infer_body(rows.tolist())).json()
    return np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(len(rows), 10)


def _http_infer(client: httpclient.InferenceServerClient, rows: np.ndarray, binary: bool) -> np.ndarray:
    tensor = httpclient.InferInput("input", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows, binary_data=binary)
    outputs = None if binary else [httpclient.InferRequestedOutput("output", binary_data=False)]
    return client.infer("digits", [tensor], outputs=outputs).as_numpy("output")


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_tritonclient_http_at_its_defaults_and_with_json(server, rows):
    base, _ = server
    batch = np.random.default_rng(rows).random((rows, 64), dtype=np.float32)
    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    binary, plain = _http_infer(client, batch, binary=True), _http_infer(client, batch, binary=False)
    assert binary.shape == (rows, 10) and binary.dtype == np.float32
    assert np.array_equal(binary, plain) and np.array_equal(binary, _json_output(base, batch))
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


def _framed(header: dict, data: bytes, length: str | None = None) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + data, {"Inference-Header-Content-Length": length if length is not None else str(len(text))}


def _binary_header(rows: int, size: int) -> dict:
    return {"inputs": [{"name": "input", "shape": [rows, 64], "datatype": "FP32",
                        "parameters": {"binary_data_size": size}}]}


def test_a_binary_request_by_hand_gets_a_binary_answer(server):
    base, _ = server
    batch = np.random.default_rng(0).random((2, 64), dtype=np.float32)
    body, headers = _framed({**_binary_header(2, batch.nbytes), "parameters": {"binary_data_output": True}},
                            batch.tobytes())
    answer = httpx.post(f"{base}/v2/models/digits/infer", content=body, headers=headers)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream"
    length = int(answer.headers["inference-header-content-length"])
    header = json.loads(answer.content[:length])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 2 * 10 * 4}
    output = np.frombuffer(answer.content[length:], dtype="<f4").reshape(2, 10)
    assert np.array_equal(output, _json_output(base, batch))


@pytest.mark.parametrize(("length", "size", "extra", "message"), [
    ("99999", 512, b"", "past the end"),
    ("-5", 512, b"", "non-negative integer"),
    ("12abc", 512, b"", "non-negative integer"),
    (None, 100, b"", "declares binary_data_size 100 but 512 bytes"),
    (None, 516, b"\0" * 4, "has 516 bytes of binary data but shape [2, 64] of FP32 needs 512"),
    (None, -1, b"", "non-negative integer"),
])
def test_malformed_binary_framing_is_a_400_with_an_error(server, length, size, extra, message):
    base, _ = server
    body, headers = _framed(_binary_header(2, size), np.zeros((2, 64), dtype=np.float32).tobytes() + extra, length)
    answer = httpx.post(f"{base}/v2/models/digits/infer", content=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]
    assert httpx.get(f"{base}/v2/health/live").status_code == 200


def _raw_post(base: str, body: bytes, header_length: str) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    request = (f"POST /v2/models/digits/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
               f"Inference-Header-Content-Length: {header_length}\r\nConnection: close\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(request)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header_length=st.one_of(st.integers(-10, 700).map(str), st.text("0123456789-+ x", max_size=6)),
       declared=st.integers(-2, 600), data=st.binary(max_size=600), rows=st.integers(1, 3))
def test_fuzzed_framing_never_crashes_or_hangs_the_server(server, header_length, declared, data, rows):
    base, _ = server
    body = json.dumps(_binary_header(rows, declared)).encode() + data
    status, payload = _raw_post(base, body, header_length)
    assert status in (200, 400), payload[:200]
    if status == 400:
        assert "error" in json.loads(payload)


def test_the_cache_keys_binary_and_json_requests_for_a_tensor_alike(server):
    base, _ = server
    batch = np.random.default_rng(42).random((3, 64), dtype=np.float32)
    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    hits = metric(base, "mlscale_cache_num_hits_per_model_total", model="digits", version="1")
    first = _json_output(base, batch)  # a miss, then cached
    assert np.array_equal(_http_infer(client, batch, binary=True), first)
    assert metric(base, "mlscale_cache_num_hits_per_model_total", model="digits", version="1") == hits + 1


def test_model_config_statistics_and_repository_index_over_http(server):
    base, _ = server
    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 64 and config["input"][0] == {"name": "input", "data_type": "TYPE_FP32",
                                                                     "dims": [64]}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    before = client.get_inference_statistics("digits")["model_stats"][0]
    for rows in (2, 5):  # not cached: new tensors
        _http_infer(client, np.random.default_rng(100 + rows).random((rows, 64), dtype=np.float32), binary=True)
    after = client.get_inference_statistics("digits")["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + 7
    success, was = after["inference_stats"]["success"], before["inference_stats"]["success"]
    assert success["count"] == was["count"] + 2 and success["ns"] > was["ns"]
    # compute counts requests (each with its batch's duration), as Triton's; executions count batches
    assert after["inference_stats"]["compute_infer"]["count"] == before["inference_stats"]["compute_infer"]["count"] + 2
    assert after["execution_count"] - before["execution_count"] in (1, 2)
    assert after["last_inference"] >= time.time() * 1e3 - 60_000
    everything = client.get_inference_statistics()["model_stats"]
    assert {(m["name"], m["version"]) for m in everything} == {("digits", "1"), ("misbehaving", "1")}
    index = client.get_model_repository_index()
    assert {(m["name"], m["version"], m["state"]) for m in index} == {("digits", "1", "READY"),
                                                                      ("misbehaving", "1", "READY")}


def test_tritonclient_grpc_infers_and_makes_every_call(server):
    base, address = server
    client = grpcclient.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("digits")
    assert "binary_tensor_data" in client.get_server_metadata().extensions
    for rows in (1, 4, 9):
        batch = np.random.default_rng(200 + rows).random((rows, 64), dtype=np.float32)
        tensor = grpcclient.InferInput("input", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch)
        result = client.infer("digits", [tensor], request_id=f"r{rows}")
        assert np.array_equal(result.as_numpy("output"), _json_output(base, batch))
        assert result.get_response().id == f"r{rows}" and result.get_response().model_version == "1"
    metadata = client.get_model_metadata("digits")
    assert metadata.inputs[0].name == "input" and list(metadata.inputs[0].shape) == [-1, 64]
    assert client.get_model_config("digits").config.max_batch_size == 64
    stats = client.get_inference_statistics("digits").model_stats[0]
    assert stats.inference_count >= 14 and stats.inference_stats.success.count >= 3
    assert {m.name for m in client.get_model_repository_index().models} == {"digits", "misbehaving"}
    assert metric(base, "mlscale_inference_request_success_total", model="digits", version="1") >= 3  # same metrics


def test_grpc_takes_typed_contents_and_maps_errors_to_status_codes(server):
    base, address = server
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(address))
    batch = np.random.default_rng(7).random((2, 64), dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[2, 64])
    tensor.contents.fp32_contents.extend(batch.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    output = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, 10)
    assert np.array_equal(output, _json_output(base, batch))

    def code_of(call, message):
        with pytest.raises(grpc.RpcError) as failure:
            call(message)
        return failure.value.code()

    assert code_of(stub.ModelInfer, service_pb2.ModelInferRequest(model_name="nope")) == grpc.StatusCode.NOT_FOUND
    bad = service_pb2.ModelInferRequest(model_name="digits")
    bad.inputs.add(name="input", datatype="FP32", shape=[2, 63]).contents.fp32_contents.extend([0.0] * 126)
    assert code_of(stub.ModelInfer, bad) == grpc.StatusCode.INVALID_ARGUMENT
    short = service_pb2.ModelInferRequest(model_name="digits", raw_input_contents=[b"\0" * 12])
    short.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    assert code_of(stub.ModelInfer, short) == grpc.StatusCode.INVALID_ARGUMENT
    unserved = grpc.insecure_channel(address).unary_unary("/inference.GRPCInferenceService/ModelStreamInfer")
    assert code_of(unserved, b"") == grpc.StatusCode.UNIMPLEMENTED


def _slow_request(rows: int = 1, first: float = 0.0) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="misbehaving")
    data = np.full((rows, 4), 0.5, dtype=np.float32)
    data[0, 0] = first
    request.inputs.add(name="input", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(data.tobytes())
    return request


def test_grpc_backpressure_is_unavailable_and_a_queue_timeout_deadline_exceeded(serve_registry):
    with running_server(serve_registry, "models:/misbehaving/1", "--queue-limit", "1", "--timeout-ms", "500",
                        "--cache-mb", "0", "--max-delay-ms", "0") as (base, process):
        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(process.grpc_address))
        codes = []

        def call(request):
            try:
                stub.ModelInfer(request, timeout=20)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())

        with ThreadPoolExecutor(8) as pool:
            pool.submit(call, _slow_request(first=SLOW))  # holds the model for 2 s
            deadline = time.time() + 10
            while metric(base, "mlscale_inference_executing", model="misbehaving", version="1") != 1:
                assert time.time() < deadline, "the slow call never started"
                time.sleep(0.02)
            for value in range(6):
                pool.submit(call, _slow_request(first=float(value)))
        assert grpc.StatusCode.UNAVAILABLE in codes  # the queue of 1 was full
        assert grpc.StatusCode.DEADLINE_EXCEEDED in codes  # the one queued waited past --timeout-ms


def test_sigterm_drains_grpc_too(serve_registry):
    with running_server(serve_registry, "models:/misbehaving/1", "--drain-delay-s", "1",
                        "--cache-mb", "0") as (_, process):
        client = grpcclient.InferenceServerClient(process.grpc_address)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(process.grpc_address))
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(stub.ModelInfer, _slow_request(first=SLOW), timeout=30)  # 2 s in the model
            time.sleep(0.3)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert not client.is_server_ready()  # load balancers stop sending
            assert stub.ModelInfer(_slow_request(), timeout=10).model_name == "misbehaving"  # still served
            assert in_flight.result().model_name == "misbehaving"  # past the drain delay: finished, not cut
        assert process.wait(timeout=30) == 0
        with pytest.raises(grpc.RpcError) as gone:
            stub.ModelInfer(_slow_request(), timeout=5)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_committed_grpc_module_is_what_the_proto_generates(tmp_path):
    proto = "mlscale/serve/proto/inference.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO), f"--python_out={tmp_path}",
                    str(REPO / proto)], check=True)
    generated = (tmp_path / "mlscale/serve/proto/inference_pb2.py").read_text()
    assert generated == (REPO / "mlscale/serve/proto/inference_pb2.py").read_text(), "run `make proto`"


def test_a_taken_grpc_port_is_one_line_before_anything_loads(serve_registry):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "mlscale", "serve", "models:/digits/1", "--port", str(free_port()),
                   "--grpc-port", str(port), "--registry", serve_registry]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"cannot serve on 127.0.0.1:{port}" in result.stderr
    assert "--grpc-port" in result.stderr and "Traceback" not in result.stderr



@pytest.mark.parametrize(("precision", "datatype", "tolerance"), [("fp16", "FP16", 2e-3), ("bf16", "BF16", 2e-2)])
def test_reduced_precision_models_over_binary_json_and_grpc(serve_registry, server, precision, datatype, tolerance):
    import ml_dtypes

    kind = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16}[datatype]
    base32, _ = server
    batch = np.random.default_rng(5).random((4, 64), dtype=np.float32)
    reference = _json_output(base32, batch)
    with running_server(serve_registry, "models:/digits/1", "--precision", precision) as (base, process):
        client = httpclient.InferenceServerClient(base.removeprefix("http://"))
        assert client.get_model_metadata("digits")["inputs"][0]["datatype"] == datatype
        assert client.get_model_config("digits")["input"][0]["data_type"] == f"TYPE_{datatype}"
        tensor = httpclient.InferInput("input", [4, 64], datatype)
        tensor.set_data_from_numpy(batch.astype(kind))
        binary = client.infer("digits", [tensor]).as_numpy("output")
        assert binary.dtype == kind and np.abs(binary.astype(np.float32) - reference).max() < tolerance
        remote = grpcclient.InferenceServerClient(process.grpc_address)
        tensor = grpcclient.InferInput("input", [4, 64], datatype)
        tensor.set_data_from_numpy(batch.astype(kind))
        assert np.array_equal(remote.infer("digits", [tensor]).as_numpy("output"), binary)
        values = batch.astype(kind).astype(np.float32).reshape(-1).tolist()
        body = {"inputs": [{"name": "input", "shape": [4, 64], "datatype": datatype, "data": values}]}
        answer = httpx.post(f"{base}/v2/models/digits/infer", json=body).json()["outputs"][0]
        assert answer["datatype"] == datatype
        assert np.array_equal(np.asarray(answer["data"], dtype=np.float32).reshape(4, 10), binary.astype(np.float32))


def test_reduced_precision_on_the_onnx_runtime_is_refused(serve_registry):
    command = [sys.executable, "-m", "mlscale", "serve", "models:/digits/1", "--precision", "bf16", "--runtime",
               "onnx", "--port", str(free_port()), "--registry", serve_registry]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "reduced-precision serving runs on the torch runtime" in result.stderr


def test_grpc_follows_a_moved_alias_like_http(serve_registry):
    from mlscale.registry import Registry

    registry = Registry(serve_registry)
    registry.set_alias("digits", 1, "production")
    try:
        with running_server(serve_registry, "models:/digits@production", "--reload-interval-s", "0.2") as (_, process):
            client = grpcclient.InferenceServerClient(process.grpc_address)
            tensor = grpcclient.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
            assert client.infer("digits", [tensor]).get_response().model_version == "1"
            registry.set_alias("digits", 2, "production")
            deadline = time.time() + 15
            while client.infer("digits", [tensor]).get_response().model_version != "2":
                assert time.time() < deadline, "the gRPC service did not follow the alias"
                time.sleep(0.1)
    finally:
        registry.set_alias("digits", 1, "production")


def test_the_grpc_port_must_not_be_the_http_port():
    from pydantic import ValidationError

    from mlscale.serve.options import ServeOptions

    with pytest.raises(ValidationError, match="is the HTTP port"):
        ServeOptions(port=9000, grpc_port=9000)


def test_a_model_not_trained_from_features_refuses_entities(server):
    base, _ = server
    answer = httpx.post(f"{base}/predict", json={"entities": [{"user_id": 1}]})
    assert answer.status_code == 400 and "not trained from features" in answer.json()["error"]
    answer = httpx.post(f"{base}/v2/models/digits/infer", json={"parameters": {"entities": "nope"}})
    assert answer.status_code == 400 and "not trained from features" in answer.json()["error"]
