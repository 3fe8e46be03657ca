"""The Open Inference Protocol v2 endpoints answer with the exact shapes of the specification."""

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlscale.registry import Registry, load_torch_model
from mlscale.serve.protocol import BadRequest, parse_v2
from mlscale.serve.runtime import TensorSpec
from tests.serve.conftest import infer_body, metric, running_server


@pytest.fixture(scope="module")
def server(serve_registry):
    with running_server(serve_registry, "models:/digits/1", "models:/digits/2", "models:/slow/1",
                        "--max-body-mb", "0.01") as (base, _):
        yield base


def test_health_and_metadata(server):
    assert httpx.get(f"{server}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{server}/v2/health/ready").json() == {"ready": True}
    meta = httpx.get(f"{server}/v2").json()
    assert meta["name"] == "mlscale" and "version" in meta
    assert meta["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]
    model = httpx.get(f"{server}/v2/models/digits").json()
    assert model == {"name": "digits", "versions": ["1", "2"], "platform": "onnxruntime_onnx",
                     "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
                     "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]}
    assert httpx.get(f"{server}/v2/models/slow").json()["platform"] == "pytorch_libtorch"
    assert httpx.get(f"{server}/v2/models/digits/versions/2/ready").json() == {"name": "digits", "ready": True}


def test_infer_matches_the_registered_model_for_each_version(server, serve_registry):
    registry = Registry(serve_registry)
    rows = np.random.default_rng(0).random((3, 64), dtype=np.float32)
    for version in (1, 2):
        response = httpx.post(f"{server}/v2/models/digits/versions/{version}/infer",
                              json={"id": "abc", **infer_body(rows.tolist())})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model_name"] == "digits" and body["model_version"] == str(version) and body["id"] == "abc"
        [out] = body["outputs"]
        assert out["name"] == "output" and out["shape"] == [3, 10] and out["datatype"] == "FP32"
        import torch

        expected = load_torch_model(registry, registry.get_version("digits", version))(torch.from_numpy(rows))
        np.testing.assert_allclose(np.array(out["data"]).reshape(3, 10), expected.detach().numpy(), atol=1e-5)
    default = httpx.post(f"{server}/v2/models/digits/infer", json=infer_body(rows.tolist())).json()
    assert default["model_version"] == "1"
    predicted = httpx.post(f"{server}/predict", json={"inputs": rows[0].tolist()}).json()
    assert len(predicted["outputs"]) == 1 and len(predicted["outputs"][0]) == 10


@pytest.mark.parametrize(("body", "status", "text"), [
    (infer_body([[0.0] * 64], name="x"), 400, "unknown input 'x'"),
    (infer_body([[0.0] * 63]), 400, "must have shape [-1, 64]"),
    (infer_body([[0.0] * 64], datatype="FP64"), 400, "datatype FP32"),
    ({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ["a"] * 64}]}, 400, "numbers"),
    ({"inputs": [{"name": "input", "shape": [2, 64], "datatype": "FP32", "data": [0.0] * 64}]}, 400, "needs 128"),
    ({"inputs": [{"name": "input", "shape": [0, 64], "datatype": "FP32", "data": []}]}, 400, "batch dimension"),
    ({"inputs": []}, 400, "one tensor"),
    ([1, 2], 400, "JSON object"),
])
def test_bad_requests_get_400_with_a_clear_error_and_the_server_keeps_serving(server, body, status, text):
    response = httpx.post(f"{server}/v2/models/digits/infer", json=body)
    assert response.status_code == status and text in response.json()["error"], response.text
    assert httpx.get(f"{server}/v2/health/ready").status_code == 200


def test_malformed_json_oversized_bodies_and_unknown_models(server):
    response = httpx.post(f"{server}/v2/models/digits/infer", content=b"{not json")
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]
    response = httpx.post(f"{server}/v2/models/digits/infer", json=infer_body([[0.5] * 64] * 100))
    assert response.status_code == 413 and "limit" in response.json()["error"]
    response = httpx.post(f"{server}/v2/models/nope/infer", json=infer_body([[0.0] * 64]))
    assert response.status_code == 404 and "unknown model 'nope'" in response.json()["error"]
    response = httpx.post(f"{server}/v2/models/digits/versions/9/infer", json=infer_body([[0.0] * 64]))
    assert response.status_code == 404
    assert httpx.get(f"{server}/v2/models/..%2F..%2Fetc/infer").status_code in (404, 405)


def test_metrics_are_exposed_in_triton_style(server):
    httpx.post(f"{server}/v2/models/digits/infer", json=infer_body([[0.25] * 64]))
    assert metric(server, "mlscale_inference_request_success_total", model="digits", version="1") >= 1
    text = httpx.get(f"{server}/metrics").text
    for name in ("mlscale_inference_request_failure_total", "mlscale_inference_request_duration_seconds_bucket",
                 "mlscale_inference_queue_duration_seconds_bucket", "mlscale_inference_compute_infer_duration_seconds",
                 "mlscale_inference_batch_size_bucket", "mlscale_cache_num_hits_per_model_total",
                 "mlscale_cache_num_misses_per_model_total", "mlscale_inference_pending_request_count",
                 "mlscale_model_loaded"):
        assert name in text, name


scalars = (st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | st.integers()
           | st.text(max_size=5))
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=6), children, max_size=4), max_leaves=20)
numbers = st.floats(allow_nan=False, allow_infinity=False, width=32) | st.integers(-5, 5)
tensors = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["input", "x", ""]) | st.text(max_size=4),
    "shape": st.lists(st.integers(-2, 70), max_size=3) | json_values,
    "datatype": st.sampled_from(["FP32", "FP64", "INT64", "BYTES", "fp32"]) | json_values,
    "data": st.lists(numbers, max_size=130) | json_values,
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional={"inputs": st.lists(tensors, max_size=2) | json_values,
                                                "outputs": json_values, "parameters": json_values,
                                                "id": json_values}) | json_values)
def test_fuzzed_requests_never_break_the_server(server, body):
    response = httpx.post(f"{server}/v2/models/digits/infer", json=body)
    assert response.status_code in (200, 400), response.text
    assert ("outputs" in response.json()) == (response.status_code == 200)


FP32 = TensorSpec("input", "FP32", (-1, 4))


def _v2(data, shape=(1, 4), spec=FP32):
    body = {"inputs": [{"name": spec.name, "shape": list(shape), "datatype": spec.datatype, "data": data}]}
    return parse_v2(body, spec, TensorSpec("output", "FP32", (-1, 2))).array


@pytest.mark.parametrize(("data", "text"), [
    ([1e39, 0.0, 0.0, 0.0], "not finite in FP32"),  # representable in JSON, not in float32
    ([0.0, 0.0, 0.0, -3.5e38], "not finite in FP32"),
    ([3.4028236e38, 0.0, 0.0, 0.0], "not finite in FP32"),  # past float32's max by more than half an ulp
    ([True, False, True, True], "numbers"),  # booleans are not numbers for FP32
    (["1.5", 0.0, 1.0, 2.0], "numbers"),
    ([None, 0.0, 1.0, 2.0], "numbers"),
    ([[1.0, 2.0], [3.0]], "evenly nested"),
    ([1.0, 2.0, 3.0], "needs 4"),
    ({"a": 1}, "list of numbers"),
])
def test_tensor_data_is_refused_unless_the_model_can_take_it(data, text):
    with pytest.raises(BadRequest, match=text):
        _v2(data)


def test_tensor_data_is_converted_to_the_model_dtype():
    array = _v2([1, 2.5, -0.0, 3.4e38])
    assert array.dtype == np.float32 and array.shape == (1, 4)
    assert array.tolist() == [[1.0, 2.5, 0.0, np.float32(3.4e38)]]
    assert _v2([[1, 2], [3, 4]]).tolist() == [[1.0, 2.0, 3.0, 4.0]]  # nested rows, same values
    top = _v2([3.4028235e38, -3.4028235e38, 0.0, 0.0])  # float32's max as printed: rounds to it
    assert top[0, 0] == np.finfo(np.float32).max and top[0, 1] == -np.finfo(np.float32).max
    as_int = _v2([1, 2, 3, 4], spec=TensorSpec("input", "INT64", (-1, 4)))
    assert as_int.dtype == np.int64 and as_int.tolist() == [[1, 2, 3, 4]]
    flags = _v2([True, False, True, True], spec=TensorSpec("input", "BOOL", (-1, 4)))
    assert flags.dtype == np.bool_


@pytest.mark.parametrize("datatype", ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                                      "INT64", "FP16", "FP32", "FP64", "BF16"])
def test_binary_tensor_data_round_trips_every_datatype(datatype):
    from mlscale.serve.protocol import array_from_bytes, array_to_bytes

    spec = TensorSpec("input", datatype, (-1, 3))
    values = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.float64) * (1 if datatype != "BOOL" else 0) + \
        (np.array([[1, 0, 1], [0, 0, 1]]) if datatype == "BOOL" else 0)
    array = values.astype(spec.dtype)
    raw = array_to_bytes(array, datatype)
    assert len(raw) == 6 * {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2}.get(
        datatype, 4 if datatype in ("UINT32", "INT32", "FP32") else 8)
    back = array_from_bytes(raw, spec, [2, 3])
    assert back.dtype == spec.dtype and np.array_equal(back, array)


def test_bf16_rounds_to_nearest_even_and_refuses_overflow():
    from mlscale.serve.protocol import array_from_bytes, array_to_bytes

    spec = TensorSpec("input", "BF16", (-1, 3))
    values = np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8, 0.1]], dtype=np.float32)  # halfway cases and an inexact one
    back = array_from_bytes(array_to_bytes(values, "BF16"), spec, [1, 3])
    assert back.tolist()[0][:2] == [1.0, 1.0 + 2**-6]  # ties go to the even mantissa
    assert abs(back[0, 2] - 0.1) < 2**-10
    with pytest.raises(BadRequest, match="not finite in BF16"):
        _v2([3.3999e38, 0.0, 0.0], shape=(1, 3), spec=spec)
