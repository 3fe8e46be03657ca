"""Decoding and validating requests (Open Inference Protocol v2 and ``/predict``), encoding responses.

Every problem with a request is a ``BadRequest`` with a message a client can act on; the server turns it
into ``400 {"error": ...}`` and goes on serving.

The binary tensor data extension (what ``tritonclient`` sends by default): the request's
``Inference-Header-Content-Length`` header says how many bytes of the body are the JSON header; the
bytes after it are the tensors' raw data, little-endian, row-major, in the order of ``inputs``, each
``parameters.binary_data_size`` long. An output asked for with ``parameters.binary_data`` (or every
output, with the request's ``parameters.binary_data_output``) comes back the same way.

A model of several inputs (``input_ids`` and ``attention_mask``: ``mlscale.registry.inputs``) takes
every one of them by name, in any order, with one batch size, and one size for each dimension they
leave open (a sequence length: the server pads or groups requests of different lengths, not the
inputs of one request); the request's inputs are a dict of arrays in the signature's order. Such a
model is served through the v2 infer route only (``/predict`` rows carry one tensor).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlscale.serve.runtime import NUMPY_TO_V2, V2_TO_NUMPY, Inputs, TensorSpec

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


def _count(data: list[Any]) -> int:
    """How many values ``data`` holds if it is evenly nested: the product of the lengths along its
    first elements (cheap; an uneven list is caught by numpy later, on a size that is known to fit)."""
    count, level = 1, data
    while isinstance(level, list):
        count *= len(level)
        if not level:
            break
        level = level[0]
    return count


def check_integers(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """Integer values within the range the model declares for the input, if it declares one (an
    embedding's ids; the datatype's own range is checked on decoding). Checked before batching, so a
    bad id is the client's 400, never a failed model call that its batch-mates pay for."""
    if array.size and spec.value_range is not None:
        low, high = spec.value_range
        smallest, largest = int(array.min()), int(array.max())
        if smallest < low or largest > high:
            bad = smallest if smallest < low else largest
            raise BadRequest(f"input '{spec.name}' holds {bad}, outside the {low}..{high} the model takes")
    return array


def _integral(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """JSON numbers into an integer datatype: whole numbers within its range, never truncated."""
    info = np.iinfo(spec.dtype)
    if array.dtype.kind == "f":
        if array.size and not (np.isfinite(array).all() and (array == np.floor(array)).all()):
            raise BadRequest(f"input '{spec.name}' ({spec.datatype}) holds values that are not whole numbers")
        above = 2.0 ** (info.bits - (info.min < 0))  # exact in float64, unlike info.max (rounds up to it)
        if array.size and (array.min() < info.min or array.max() >= above):
            raise BadRequest(f"input '{spec.name}' holds values outside the range of {spec.datatype}")
    elif array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
        raise BadRequest(f"input '{spec.name}' holds values outside the range of {spec.datatype}")
    return check_integers(array.astype(spec.dtype), spec)


def as_array(data: Any, spec: TensorSpec, shape: list[int]) -> np.ndarray:
    if not isinstance(data, list):
        raise BadRequest("'data' must be a list of numbers")
    expected = math.prod(shape)
    if _count(data) != expected:  # before numpy builds anything: a huge body of [0],[0],... costs nothing
        raise BadRequest(f"'data' has {_count(data)} values but shape {shape} needs {expected}")
    try:
        array = np.asarray(data)
    except (ValueError, TypeError):
        raise BadRequest("'data' must be a flat (or evenly nested) list of numbers") from None
    kind, dtype = array.dtype.kind, spec.dtype
    if kind not in "biuf" or (kind == "b" and spec.datatype != "BOOL"):
        raise BadRequest(f"'data' must hold numbers for datatype {spec.datatype}")
    if array.size != expected:
        raise BadRequest(f"'data' has {array.size} values but shape {shape} needs {expected}")
    if dtype.kind in "iu" and kind != "b":
        return _integral(array.reshape(shape), spec)
    if kind == "f" and dtype.kind == "f":
        # JSON numbers (float64) into a float model, the usual case: one range check before the cast
        # (NaN fails it too), so the cast cannot overflow (no np.errstate needed).
        if array.size and not np.abs(array).max() < _ROUNDS_TO_INF[dtype]:
            raise BadRequest("'data' holds values that are not finite in " + spec.datatype)
        if spec.datatype == "BF16":  # to the nearest BF16 value, as binary data would carry it
            return as_bf16(array.reshape(shape).astype(np.float32), spec.datatype)
        return array.reshape(shape).astype(dtype)
    with np.errstate(all="ignore"):
        converted = array.reshape(shape).astype(dtype)
    if dtype.kind == "f" and not np.isfinite(converted).all():
        raise BadRequest("'data' holds values that are not finite in " + spec.datatype)
    return as_bf16(converted, spec.datatype) if spec.datatype == "BF16" else converted


def check_shape(spec: TensorSpec, shape: Any) -> list[int]:
    if type(shape) is not list or any(type(d) is not int for d in shape):  # JSON: no bools, no floats
        raise BadRequest("'shape' must be a list of integers")
    expected = spec.shape
    if len(shape) != len(expected) or any(e != -1 and d != e for d, e in zip(shape, expected)):
        what = "any size" if -1 in expected[1:] else "any batch size"
        raise BadRequest(f"input '{spec.name}' must have shape {list(expected)} (-1: {what}), got {shape}")
    if not 1 <= shape[0] <= MAX_ROWS:
        raise BadRequest(f"batch dimension must be between 1 and {MAX_ROWS}, got {shape[0]}")
    return shape


def check_json_cost(body: bytes, spec: TensorSpec) -> None:
    """Refuse, before decoding, a JSON body that holds far more numbers or lists than any request for
    this input can: decoding builds a Python object per value while holding the interpreter (a thread
    does not help), and 8 MB of ``[0],[0],...`` takes seconds. Counting bytes costs milliseconds. An
    input with a dynamic dimension past the batch has no such bound: only the body size limits it."""
    dims = spec.shape[1:]
    if any(d < 0 for d in dims):
        return
    values = MAX_ROWS * math.prod(dims)  # commas: one fewer than the values, nested or flat
    # lists: a row nested as the shape is 1 + d1 + d1*d2 + ... lists (all but the innermost level)
    lists = MAX_ROWS * sum(math.prod(dims[:k]) for k in range(len(dims)))
    slack = 1024  # the other fields: shape, outputs, parameters, entities, ids
    if body.count(b",") > values + slack or body.count(b"[") > lists + slack:
        raise BadRequest(f"the request holds more values or lists than input '{spec.name}' of shape "
                         f"{list(spec.shape)} takes (at most {MAX_ROWS} rows)")


@dataclass
class V2Request:
    array: Inputs | None  # None: the request names entities, whose features make the tensor
    parameters: dict[str, Any] = field(default_factory=dict)  # what may change the answer (the cache's key)
    request_id: str | None = None
    binary_output: bool = False
    entities: Any = None  # ``parameters.entities`` (a model trained from features)
    return_features: bool = False


_LENGTH = re.compile(rb"[0-9]{1,18}")
# Request parameters that change an answer, and so belong in the cache key: none of the models served
# takes any. The others (binary_data_output, timeout, priority, sequence ids...) say how or when to
# answer, not what: a JSON, a binary and a gRPC request for one tensor share one cache entry.
ANSWER_PARAMETERS: tuple[str, ...] = ()


def answer_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in parameters.items() if key in ANSWER_PARAMETERS}


def check_input(spec: TensorSpec, name: Any, datatype: Any, shape: Any, count: int = 1) -> list[int]:
    """The request's one input tensor named, typed and shaped as the model takes it; its shape."""
    if count != 1:
        raise BadRequest(f"'inputs' must be a list with one tensor, '{spec.name}'")
    if name != spec.name:
        raise BadRequest(f"unknown input {name!r}: this model takes '{spec.name}'")
    if datatype != spec.datatype:
        raise BadRequest(f"input '{spec.name}' must have datatype {spec.datatype}, got {datatype!r}")
    return check_shape(spec, shape)


def _takes(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(f"'{spec.name}'" for spec in specs)


def check_inputs(specs: Sequence[TensorSpec],
                 tensors: list[tuple[Any, Any, Any]]) -> list[tuple[TensorSpec, list[int]]]:
    """A request's tensors, each ``(name, datatype, shape)``, against the model's inputs: for a model of
    one input, that one (``check_input``); else every input once, by name, typed and shaped as the model
    takes it, with one batch size and one size per open dimension. The spec and shape of each tensor,
    in the request's order."""
    if len(specs) == 1:
        name, datatype, shape = tensors[0] if tensors else (None, None, None)
        return [(specs[0], check_input(specs[0], name, datatype, shape, len(tensors)))]
    by_name = {spec.name: spec for spec in specs}
    names = [name for name, _, _ in tensors]
    unknown = next((name for name in names if name not in by_name), None)
    if unknown is not None:
        raise BadRequest(f"unknown input {unknown!r}: this model takes {_takes(specs)}")
    missing = [spec.name for spec in specs if spec.name not in names]
    if missing or len(names) != len(specs):
        what = f"lacks {', '.join(repr(n) for n in missing)}" if missing else "names an input twice"
        raise BadRequest(f"'inputs' {what}: this model takes {_takes(specs)}, each once")
    checked = []
    for name, datatype, shape in tensors:
        spec = by_name[name]
        if datatype != spec.datatype:
            raise BadRequest(f"input '{spec.name}' must have datatype {spec.datatype}, got {datatype!r}")
        checked.append((spec, check_shape(spec, shape)))
    _check_open_dims(checked)
    return checked


def _check_open_dims(checked: list[tuple[TensorSpec, list[int]]]) -> None:
    """One size per open dimension across a request's inputs (a batch size; a sequence length, at
    least 1): a model of several inputs takes them as one padded batch."""
    seen: dict[int, tuple[str, int]] = {}
    for spec, shape in checked:
        for dim, size in enumerate(shape):
            if spec.shape[dim] != -1:
                continue
            if size < 1:
                raise BadRequest(f"dimension {dim} of input '{spec.name}' must be at least 1, got {size}")
            first = seen.setdefault(dim, (spec.name, size))
            if first[1] != size:
                raise BadRequest(f"inputs '{first[0]}' and '{spec.name}' differ in dimension {dim} ({first[1]} vs "
                                 f"{size}): a request's inputs must agree on it")


def by_signature(specs: Sequence[TensorSpec], arrays: list[tuple[TensorSpec, np.ndarray]]) -> Inputs:
    """A request's arrays as the runtime takes them: the one array of a model of one input, else a dict
    by name in the signature's order."""
    if len(specs) == 1:
        return arrays[0][1]
    found = {spec.name: array for spec, array in arrays}
    return {spec.name: found[spec.name] for spec in specs}


def check_outputs(output: TensorSpec, names: list[Any]) -> None:
    if any(name != output.name for name in names):
        raise BadRequest(f"'outputs' may only name '{output.name}'")


def split_body(body: bytes, header_length: bytes | None) -> tuple[bytes, bytes]:
    """(JSON header, binary data) of a body framed by ``Inference-Header-Content-Length``."""
    if header_length is None:
        return body, b""
    if not _LENGTH.fullmatch(header_length.strip()):
        raise BadRequest(f"Inference-Header-Content-Length must be a non-negative integer, got "
                         f"{header_length.decode('latin-1')[:40]!r}")
    length = int(header_length)
    if length > len(body):
        raise BadRequest(f"Inference-Header-Content-Length {length} is past the end of the {len(body)}-byte body")
    return body[:length], body[length:]


def array_from_bytes(raw: bytes, spec: TensorSpec, shape: list[int]) -> np.ndarray:
    """A tensor from its raw little-endian bytes; refused unless there are exactly shape x dtype bytes
    and, for floats, every value is finite (as for JSON data)."""
    wire = wire_dtype(spec.datatype)
    needed = math.prod(shape) * wire.itemsize
    if len(raw) != needed:
        raise BadRequest(f"input '{spec.name}' has {len(raw)} bytes of binary data but shape {shape} of "
                         f"{spec.datatype} needs {needed}")
    values = np.frombuffer(raw, dtype=wire).reshape(shape)
    if spec.datatype == "BF16":  # the upper half of a float32: widen exactly
        values = (values.astype(np.uint32) << 16).view(np.float32)
    elif spec.datatype == "BOOL":
        values = values != 0
    array = values.astype(spec.dtype)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise BadRequest("binary data holds values that are not finite in " + spec.datatype)
    return check_integers(array, spec) if array.dtype.kind in "iu" else array


def wire_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a datatype's raw bytes (BF16: its bits, as little-endian uint16)."""
    if datatype == "BF16":
        return np.dtype("<u2")
    if datatype == "BOOL":
        return np.dtype("u1")
    return V2_TO_NUMPY[datatype].newbyteorder("<")


def _bf16_bits(array: np.ndarray) -> np.ndarray:
    """The BF16 bits nearest to float32 values (round half to even on the dropped half)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    return ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")


def as_bf16(array: np.ndarray, datatype: str) -> np.ndarray:
    """float32 values rounded to BF16 (still float32); refused if that overflows."""
    rounded = (_bf16_bits(array).astype(np.uint32) << 16).view(np.float32)
    if not np.isfinite(rounded).all():
        raise BadRequest("'data' holds values that are not finite in " + datatype)
    return rounded


def array_to_bytes(array: np.ndarray, datatype: str) -> bytes:
    """Raw little-endian bytes of a tensor in ``datatype`` (BF16: rounded to nearest even)."""
    if datatype == "BF16":
        return _bf16_bits(array).tobytes()
    return np.ascontiguousarray(array, dtype=wire_dtype(datatype)).tobytes()


def _flag(parameters: Any, name: str) -> bool | None:
    value = parameters.get(name) if isinstance(parameters, dict) else None
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"parameter '{name}' must be true or false")
    return value


def _request_id(body: dict[str, Any]) -> str | None:
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    return request_id


def parse_v2(body: Any, spec: TensorSpec | Sequence[TensorSpec], output: TensorSpec,
             binary: bytes = b"") -> V2Request:
    """An Open Inference Protocol infer request for a model of one input (``spec``) or several (the list
    of them, in the signature's order); ``binary``: the bytes after the JSON header."""
    specs = [spec] if isinstance(spec, TensorSpec) else list(spec)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    parameters = body.get("parameters") or {}
    if isinstance(parameters, dict) and "entities" in parameters and not body.get("inputs"):
        return V2Request(None, {}, _request_id(body), bool(_flag(parameters, "binary_data_output")),
                         entities=parameters["entities"], return_features=bool(_flag(parameters, "return_features")))
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(tensor, dict) for tensor in inputs):
        if len(specs) == 1:
            raise BadRequest(f"'inputs' must be a list with one tensor, '{specs[0].name}'")
        raise BadRequest(f"'inputs' must be a list of the tensors {_takes(specs)}")
    checked = check_inputs(specs, [(t.get("name"), t.get("datatype"), t.get("shape")) for t in inputs])
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be an object")
    binary_output = bool(_flag(parameters, "binary_data_output"))
    requested = body.get("outputs")
    if requested is not None:
        if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
            raise BadRequest(f"'outputs' may only name '{output.name}'")
        check_outputs(output, [o.get("name") for o in requested])
        for wanted in requested:
            choice = _flag(wanted.get("parameters") or {}, "binary_data")
            binary_output = binary_output if choice is None else choice
    request_id = _request_id(body)
    arrays = _tensor_data(list(zip(inputs, checked)), binary)
    return V2Request(by_signature(specs, arrays), answer_parameters(parameters), request_id, binary_output)


def _binary_sizes(tensors: list[tuple[dict[str, Any], tuple[TensorSpec, list[int]]]]) -> list[int | None]:
    """Each tensor's ``parameters.binary_data_size`` (None: its values are JSON ``data``)."""
    sizes = []
    for tensor, (spec, _) in tensors:
        tensor_parameters = tensor.get("parameters") or {}
        if not isinstance(tensor_parameters, dict):
            raise BadRequest(f"the 'parameters' of input '{spec.name}' must be an object")
        size = tensor_parameters.get("binary_data_size")
        if size is not None and (type(size) is not int or size < 0):
            raise BadRequest("'binary_data_size' must be a non-negative integer")
        sizes.append(size)
    return sizes


def _tensor_data(tensors: list[tuple[dict[str, Any], tuple[TensorSpec, list[int]]]],
                 binary: bytes) -> list[tuple[TensorSpec, np.ndarray]]:
    """Each tensor's values: its JSON ``data``, or its ``binary_data_size`` bytes of ``binary`` (the
    tensors' raw data one after the other, in the request's order)."""
    sizes = _binary_sizes(tensors)
    declared = sum(size for size in sizes if size is not None)
    if binary and all(size is None for size in sizes):
        raise BadRequest(f"{len(binary)} bytes of binary data follow the JSON header, but no input has "
                         "'binary_data_size'")
    if any(size is not None for size in sizes) and declared != len(binary):
        if len(tensors) == 1:
            raise BadRequest(f"input '{tensors[0][1][0].name}' declares binary_data_size {declared} but "
                             f"{len(binary)} bytes of binary data follow the JSON header")
        raise BadRequest(f"the inputs declare {declared} bytes of binary data (binary_data_size) but {len(binary)} "
                         "follow the JSON header")
    arrays, offset = [], 0
    for (tensor, (spec, shape)), size in zip(tensors, sizes):
        if size is None:
            arrays.append((spec, as_array(tensor.get("data"), spec, shape)))
        else:
            arrays.append((spec, array_from_bytes(binary[offset:offset + size], spec, shape)))
            offset += size
    return arrays


def parse_predict(body: Any, spec: TensorSpec) -> V2Request:
    """``{"inputs": [[...], [...]]}`` (rows), ``{"inputs": [...]}`` (one row) or ``{"entities": [...]}``."""
    if isinstance(body, dict) and "entities" in body and "inputs" not in body:
        return V2Request(None, entities=body["entities"], return_features=body.get("return_features") is True)
    if not isinstance(body, dict) or "inputs" not in body:
        raise BadRequest('the body must be {"inputs": [[...], ...]}')
    if -1 in spec.shape[1:]:
        raise BadRequest(f"input '{spec.name}' has dimensions of any size, which rows of /predict cannot say: "
                         "send an Open Inference Protocol request (/v2/models/NAME/infer)")
    rows = body["inputs"]
    if isinstance(rows, list) and rows and not isinstance(rows[0], list):
        rows = [rows]
    if not isinstance(rows, list) or not rows:
        raise BadRequest("'inputs' must be a non-empty list of rows")
    row_shape = list(spec.shape[1:])
    return V2Request(as_array(rows, spec, check_shape(spec, [len(rows), *row_shape])))


def output_datatype(array: np.ndarray, output: TensorSpec) -> str:
    """The datatype of a computed output: the model's, unless the array says otherwise."""
    return output.datatype if array.dtype == output.dtype else NUMPY_TO_V2.get(array.dtype, output.datatype)


def v2_response(model: str, version: int, output: TensorSpec, array: np.ndarray, request_id: Any,
                binary: bool = False) -> tuple[dict[str, Any], bytes]:
    """The answer's JSON and, for a binary output, its raw bytes (to follow the JSON)."""
    datatype = output_datatype(array, output)
    tensor: dict[str, Any] = {"name": output.name, "shape": list(array.shape), "datatype": datatype}
    raw = b""
    if binary:
        raw = array_to_bytes(array, datatype)
        tensor["parameters"] = {"binary_data_size": len(raw)}
    else:
        tensor["data"] = np.ascontiguousarray(array).reshape(-1)
    response: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": [tensor]}
    if request_id is not None:
        response["id"] = request_id
    return response, raw
