"""A model of several inputs from end to end: a BERT classifier from ``transformers`` (built from a config)
trained on a Dataset of token-id sequences of different lengths (``PadCollate`` makes the attention
mask), registered, exported and served. The registry's signature names ``input_ids`` and
``attention_mask`` with a dynamic sequence; the ONNX graph takes them by name with the sequence dynamic;
the server answers tritonclient's requests (HTTP and gRPC, at their defaults: binary tensors) carrying
both inputs, of different lengths, sent at once so that they share batches, each with exactly what the
model answers that request alone in PyTorch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from mlscale.export.session import onnx_session
from mlscale.registry import Registry, load_torch_model
from tests.helpers import run_cli, shared_copy
from tests.serve.conftest import metric, running_server

pytestmark = pytest.mark.timeout(300)
VOCAB = 32  # tests.user_models


def _build(root) -> None:
    registry = str(root / "registry")
    trained = run_cli("train", "--task", "tests.user_models:bert", "--steps", "3", "--batch-size", "8",
                      "--run-dir", str(root / "bert"), "--no-progress", "--register", "bert", "--registry", registry,
                      timeout=240)
    assert trained.returncode == 0, trained.stderr
    exported = run_cli("export", "models:/bert/1", "--registry", registry, timeout=240)
    assert exported.returncode == 0, exported.stderr


@pytest.fixture(scope="module")
def location(tmp_path_factory) -> str:
    return str(shared_copy(tmp_path_factory, "bert", _build) / "registry")


def _requests(count: int) -> list[dict[str, np.ndarray]]:
    """``count`` requests of 1 or 2 rows, each of its own sequence length (3, 4, 5, ...): any two in one
    batch differ in length. A second row is shorter than the first, padded and masked by the client."""
    rng = np.random.default_rng(0)
    requests = []
    for i in range(count):
        length, rows = 3 + i, 1 + i % 2
        ids = rng.integers(1, VOCAB, (rows, length))
        mask = np.ones((rows, length), dtype=np.int64)
        if rows == 2:
            ids[1, length - 2:], mask[1, length - 2:] = 0, 0
        requests.append({"input_ids": ids, "attention_mask": mask})
    return requests


def _alone(model: torch.nn.Module, request: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return model(**{name: torch.from_numpy(array) for name, array in request.items()}).logits.numpy()


def test_the_signature_and_the_onnx_graph_name_both_inputs_with_a_dynamic_sequence(location):
    registry = Registry(location)
    version = registry.resolve("models:/bert/1")
    assert version.signature == {
        "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1], "range": [0, VOCAB - 1]},
                   {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 2]}]}
    onnx = version.artifacts["model.onnx"].info
    assert onnx["parity"]["passed"] and onnx["parity"]["batch_sizes"] == [1, 7, 24]
    assert onnx["dynamic_axes"] == {"input_ids": [0, 1], "attention_mask": [0, 1], "output": [0]}
    session = onnx_session(registry.artifact_bytes(version, "model.onnx"))
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("input_ids", ["batch", "sequence"]),
                                                                 ("attention_mask", ["batch", "sequence"])]
    model = load_torch_model(registry, version)
    for request in _requests(4)[1:]:  # lengths the held-out batches need not have had
        np.testing.assert_allclose(session.run(["output"], request)[0], _alone(model, request), rtol=1e-4, atol=1e-5)


def _http_infer(client: httpclient.InferenceServerClient, request: dict[str, np.ndarray]):
    tensors = []
    for name, array in request.items():
        tensor = httpclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.async_infer("bert", tensors)


def _grpc_infer(client: grpcclient.InferenceServerClient, request: dict[str, np.ndarray]) -> np.ndarray:
    tensors = []
    for name in ("attention_mask", "input_ids"):  # by name, in any order
        tensor = grpcclient.InferInput(name, list(request[name].shape), "INT64")
        tensor.set_data_from_numpy(request[name])
        tensors.append(tensor)
    return client.infer("bert", tensors).as_numpy("output")


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_requests_of_different_lengths_share_batches_and_each_gets_its_own_answer(location, runtime):
    registry = Registry(location)
    model = load_torch_model(registry, registry.resolve("models:/bert/1"))
    requests = _requests(24)
    with running_server(location, "models:/bert/1", "--runtime", runtime, "--cache-mb", "0",
                        "--max-delay-ms", "20") as (base, process):
        http = httpclient.InferenceServerClient(base.removeprefix("http://"), concurrency=12)
        metadata = http.get_model_metadata("bert")
        assert [(i["name"], i["shape"]) for i in metadata["inputs"]] == [("input_ids", [-1, -1]),
                                                                          ("attention_mask", [-1, -1])]
        rounds = 0
        # at once, so that they queue behind each other's batches; on busy cores a round may find the
        # model idle at every arrival (each request then runs alone), so rounds go on, up to 20, until
        # some batch held several requests
        while rounds < 20:
            rounds += 1
            pending = [_http_infer(http, request) for request in requests]
            answers = [result.get_result().as_numpy("output") for result in pending]
            if _executions(base) < rounds * len(requests):
                break
        grpc = grpcclient.InferenceServerClient(process.grpc_address)
        with ThreadPoolExecutor(12) as pool:
            grpc_answers = list(pool.map(lambda request: _grpc_infer(grpc, request), requests))
        executions = _executions(base)
        served = metric(base, "mlscale_inference_request_success_total", model="bert", version="1")
    assert served == (rounds + 1) * len(requests)
    assert executions < served  # batches held several requests, so of several lengths (every length differs)
    for request, http_answer, grpc_answer in zip(requests, answers, grpc_answers):
        expected = _alone(model, request)
        assert http_answer.shape == grpc_answer.shape == (len(request["input_ids"]), 2)
        np.testing.assert_allclose(http_answer, expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(grpc_answer, expected, rtol=1e-4, atol=1e-5)


def _executions(base: str) -> float:
    return metric(base, "mlscale_inference_exec_count_total", model="bert", version="1")


def test_plain_json_takes_both_inputs_in_any_order_the_cache_keys_both_and_a_request_lacking_one_is_a_400(location):
    registry = Registry(location)
    model = load_torch_model(registry, registry.resolve("models:/bert/1"))
    request = _requests(6)[5]
    body = {"inputs": [{"name": name, "shape": list(request[name].shape), "datatype": "INT64",
                        "data": request[name].reshape(-1).tolist()} for name in ("attention_mask", "input_ids")]}
    ids = np.ones((1, 5), dtype=np.int64)
    cases = [({"input_ids": ids}, "lacks 'attention_mask'"),
             ({"input_ids": ids, "attention_mask": np.ones((1, 4), dtype=np.int64)}, "differ in dimension 1"),
             ({"input_ids": ids * VOCAB, "attention_mask": ids}, f"outside the 0..{VOCAB - 1}")]
    with running_server(location, "models:/bert/1", "--runtime", "onnx", "--no-grpc") as (base, _):
        answer = httpx.post(f"{base}/v2/models/bert/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        output = answer.json()["outputs"][0]
        np.testing.assert_allclose(np.reshape(output["data"], output["shape"]), _alone(model, request), rtol=1e-4,
                                   atol=1e-5)
        client = httpclient.InferenceServerClient(base.removeprefix("http://"))
        binary = [client.infer("bert", [_input(name, array) for name, array in request.items()]).as_numpy("output")
                  for _ in range(2)]  # the same inputs as the JSON request: its cached answer (keyed by every input)
        assert np.array_equal(binary[0], binary[1])
        assert np.allclose(binary[0], np.reshape(output["data"], output["shape"]))
        assert metric(base, "mlscale_cache_num_hits_per_model_total", model="bert", version="1") == 2
        for inputs, says in cases:
            with pytest.raises(InferenceServerException, match=says):
                client.infer("bert", [_input(name, array) for name, array in inputs.items()])


def _input(name: str, array: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), "INT64")
    tensor.set_data_from_numpy(array)
    return tensor
