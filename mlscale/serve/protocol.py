"""Decoding and validating requests (Open Inference Protocol v2 and ``/predict``), encoding responses.

Every problem with a request is a ``BadRequest`` with a message a client can act on; the server turns it
into ``400 {"error": ...}`` and goes on serving.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mlscale.serve.runtime import NUMPY_TO_V2, TensorSpec

MAX_ROWS = 4096


class BadRequest(Exception):
    pass


# Per float dtype, the magnitude from which a float64 rounds to infinity when cast to it (the largest
# finite value plus half a unit in the last place): below it the cast rounds to a finite value, so
# float32's maximum printed as 3.4028235e38 is taken. For float64 it is inf, refusing only inf and NaN.
def _rounds_to_inf(kind: type[np.floating]) -> float:
    top = np.finfo(kind).max
    ulp = float(top) - float(np.nextafter(top, kind(0)))  # the top binade's spacing
    return float(top) + ulp / 2  # inf for float64


_ROUNDS_TO_INF = {np.dtype(t): _rounds_to_inf(t) for t in (np.float16, np.float32, np.float64)}


def _as_array(data: Any, spec: TensorSpec, shape: list[int]) -> np.ndarray:
    if not isinstance(data, list):
        raise BadRequest("'data' must be a list of numbers")
    try:
        array = np.asarray(data)
    except (ValueError, TypeError):
        raise BadRequest("'data' must be a flat (or evenly nested) list of numbers") from None
    kind, dtype = array.dtype.kind, spec.dtype
    if kind not in "biuf" or (kind == "b" and spec.datatype != "BOOL"):
        raise BadRequest(f"'data' must hold numbers for datatype {spec.datatype}")
    if array.size != math.prod(shape):
        raise BadRequest(f"'data' has {array.size} values but shape {shape} needs {math.prod(shape)}")
    if kind == "f" and dtype.kind == "f":
        # JSON numbers (float64) into a float model, the usual case: one range check before the cast
        # (NaN fails it too), so the cast cannot overflow (no np.errstate needed).
        if array.size and not np.abs(array).max() < _ROUNDS_TO_INF[dtype]:
            raise BadRequest("'data' holds values that are not finite in " + spec.datatype)
        return array.reshape(shape).astype(dtype)
    with np.errstate(all="ignore"):
        converted = array.reshape(shape).astype(dtype)
    if dtype.kind == "f" and not np.isfinite(converted).all():
        raise BadRequest("'data' holds values that are not finite in " + spec.datatype)
    return converted


def check_shape(spec: TensorSpec, shape: Any) -> list[int]:
    if type(shape) is not list or any(type(d) is not int for d in shape):  # JSON: no bools, no floats
        raise BadRequest("'shape' must be a list of integers")
    expected = spec.shape
    if len(shape) != len(expected) or any(e != -1 and d != e for d, e in zip(shape, expected)):
        raise BadRequest(f"input '{spec.name}' must have shape {list(expected)} (-1: any batch size), got {shape}")
    if not 1 <= shape[0] <= MAX_ROWS:
        raise BadRequest(f"batch dimension must be between 1 and {MAX_ROWS}, got {shape[0]}")
    return shape


def parse_v2(body: Any, spec: TensorSpec, output: TensorSpec) -> tuple[np.ndarray, dict[str, Any], Any]:
    """(input array, parameters, request id) from an Open Inference Protocol infer request."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadRequest(f"'inputs' must be a list with one tensor, '{spec.name}'")
    tensor = inputs[0]
    if tensor.get("name") != spec.name:
        raise BadRequest(f"unknown input {tensor.get('name')!r}: this model takes '{spec.name}'")
    if tensor.get("datatype") != spec.datatype:
        raise BadRequest(f"input '{spec.name}' must have datatype {spec.datatype}, got {tensor.get('datatype')!r}")
    shape = check_shape(spec, tensor.get("shape"))
    requested = body.get("outputs")
    if requested is not None and (not isinstance(requested, list) or any(
            not isinstance(o, dict) or o.get("name") != output.name for o in requested)):
        raise BadRequest(f"'outputs' may only name '{output.name}'")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be an object")
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    return _as_array(tensor.get("data"), spec, shape), parameters, request_id


def parse_predict(body: Any, spec: TensorSpec) -> np.ndarray:
    """``{"inputs": [[...], [...]]}`` (rows) or ``{"inputs": [...]}`` (one row)."""
    if not isinstance(body, dict) or "inputs" not in body:
        raise BadRequest('the body must be {"inputs": [[...], ...]}')
    rows = body["inputs"]
    if isinstance(rows, list) and rows and not isinstance(rows[0], list):
        rows = [rows]
    if not isinstance(rows, list) or not rows:
        raise BadRequest("'inputs' must be a non-empty list of rows")
    row_shape = list(spec.shape[1:])
    return _as_array(rows, spec, check_shape(spec, [len(rows), *row_shape]))


def v2_response(model: str, version: int, output: TensorSpec, array: np.ndarray, request_id: Any) -> dict[str, Any]:
    response = {
        "model_name": model,
        "model_version": str(version),
        "outputs": [{"name": output.name, "shape": list(array.shape),
                     "datatype": NUMPY_TO_V2.get(array.dtype, output.datatype),
                     "data": np.ascontiguousarray(array).reshape(-1)}],
    }
    if request_id is not None:
        response["id"] = request_id
    return response


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}

