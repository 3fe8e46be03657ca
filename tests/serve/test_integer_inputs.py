"""Integer inputs are taken only as whole numbers within the datatype, and within the ids the model
declares (an embedding's vocabulary): never truncated, wrapped or handed to the model to fail on."""

import numpy as np
import pytest

from mlscale.serve.protocol import BadRequest, array_from_bytes, as_array, check_json_cost
from mlscale.serve.runtime import TensorSpec

IDS = TensorSpec("input", "INT64", (-1, 2), value_range=(0, 28))


@pytest.mark.parametrize(("datatype", "value", "says"), [
    ("INT64", 1.7, "not whole numbers"), ("INT64", float("nan"), "not whole numbers"),
    ("INT64", 2.0**63, "outside the range of INT64"),  # rounds to INT64_MAX as a float: must not wrap
    ("UINT64", 2.0**64, "outside the range of UINT64"), ("UINT64", -1, "outside the range of UINT64"),
    ("INT32", 2**31, "outside the range of INT32"), ("UINT8", 256, "outside the range of UINT8"),
])
def test_values_an_integer_datatype_cannot_hold_exactly_are_refused(datatype, value, says):
    with pytest.raises(BadRequest, match=says):
        as_array([value, 1], TensorSpec("input", datatype, (-1, 2)), [1, 2])


@pytest.mark.parametrize("value", [2**63 - 1, -(2**63), 0, 5.0])
def test_whole_numbers_within_the_datatype_are_taken_exactly(value):
    array = as_array([value, 1], TensorSpec("input", "INT64", (-1, 2)), [1, 2])
    assert array.dtype == np.int64 and int(array[0, 0]) == int(value)


@pytest.mark.parametrize("ids", [[-1, 0], [0, 29]])
def test_ids_outside_the_declared_range_are_refused_as_json_and_as_binary_data(ids):
    with pytest.raises(BadRequest, match=r"outside the 0\.\.28"):
        as_array(ids, IDS, [1, 2])
    with pytest.raises(BadRequest, match=r"outside the 0\.\.28"):
        array_from_bytes(np.asarray(ids, dtype="<i8").tobytes(), IDS, [1, 2])
    assert as_array([0, 28], IDS, [1, 2]).tolist() == [[0, 28]]


def test_the_json_cost_bound_takes_the_largest_nested_request_and_refuses_far_more():
    import json

    image = TensorSpec("input", "FP32", (-1, 1, 8, 8))
    largest = {"inputs": [{"name": "input", "shape": [4096, 1, 8, 8], "datatype": "FP32",
                           "data": [[[[0.5] * 8] * 8]] * 4096}]}
    check_json_cost(json.dumps(largest).encode(), image)  # 4096 rows, nested as the shape: taken
    with pytest.raises(BadRequest, match="more values or lists"):
        check_json_cost(b"[" + b",".join([b"[0]"] * 300_000) + b"]", image)
