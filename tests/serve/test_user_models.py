"""Serving models nobody here wrote: GPT-2 (tied head, returns a ``ModelOutput``) and a CNN returning a
dict are served their predictions tensor (the logits) over HTTP and gRPC, by the torch runtime and by
their ONNX exports alike; the server knows only the runtime and the signature."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from mlscale.registry import Registry, load_torch_model
from tests.helpers import user_models_registry
from tests.serve.conftest import running_server

# Trained runs of Hugging Face models built by the first test that needs them: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def location(tmp_path_factory):
    return str(user_models_registry(tmp_path_factory))


@pytest.fixture(scope="module")
def expected(location):
    """The logits PyTorch gives for a few inputs of each model (token ids; 8x8 images as 64 floats)."""
    registry = Registry(location)
    rng = np.random.default_rng(0)
    inputs = {"gpt2": rng.integers(0, 32, (3, 16)), "cnn": rng.random((3, 64), dtype=np.float32)}
    logits = {}
    for name, rows in inputs.items():
        model = load_torch_model(registry, registry.resolve(f"models:/{name}/1"))
        with torch.no_grad():
            output = model(torch.from_numpy(rows))
        logits[name] = (output.logits if name == "gpt2" else output["logits"]).numpy()
    return inputs, logits


def _infer(base: str, name: str, rows: np.ndarray) -> np.ndarray:
    datatype = "INT64" if rows.dtype == np.int64 else "FP32"
    body = {"inputs": [{"name": "input", "shape": list(rows.shape), "datatype": datatype,
                        "data": rows.reshape(-1).tolist()}]}
    answer = httpx.post(f"{base}/v2/models/{name}/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    output = answer.json()["outputs"][0]
    assert output["name"] == "output" and output["datatype"] == "FP32"
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


@pytest.mark.parametrize(("runtime", "tolerance"), [("torch", 1e-6), ("onnx", 1e-5)])
def test_gpt2_and_a_dict_returning_cnn_answer_with_their_logits_over_http_and_grpc(location, expected, runtime,
                                                                                  tolerance):
    inputs, logits = expected
    with running_server(location, "models:/gpt2/1", "models:/cnn/1", "--runtime", runtime,
                        "--cache-mb", "0") as (base, process):
        metadata = httpx.get(f"{base}/v2/models/gpt2").json()
        assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 16, 32]}]
        for name in ("gpt2", "cnn"):
            answer = _infer(base, name, inputs[name])
            assert answer.shape == logits[name].shape
            np.testing.assert_allclose(answer, logits[name], rtol=tolerance, atol=tolerance)
        client = grpcclient.InferenceServerClient(process.grpc_address)
        ids = grpcclient.InferInput("input", list(inputs["gpt2"].shape), "INT64")
        ids.set_data_from_numpy(inputs["gpt2"])
        np.testing.assert_allclose(client.infer("gpt2", [ids]).as_numpy("output"), logits["gpt2"], rtol=tolerance,
                                   atol=tolerance)
