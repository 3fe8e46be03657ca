"""The one map of tensor datatype names: the Open Inference Protocol's (``FP32``) to the names numpy
and torch share (``float32``). A registered signature, a served tensor and a request all use it."""

from __future__ import annotations

from typing import Any

V2_TO_NAME = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
              "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
              "FP32": "float32", "FP64": "float64", "BF16": "bfloat16"}  # numpy has no bfloat16
NAME_TO_V2 = {name: v2 for v2, name in V2_TO_NAME.items()}


def v2_datatype(dtype: Any) -> str:
    """The protocol's name of a torch dtype or a numpy dtype instance (``torch.float32``,
    ``np.dtype("float32")`` -> ``FP32``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in NAME_TO_V2:
        raise ValueError(f"dtype {name} has no Open Inference Protocol datatype")
    return NAME_TO_V2[name]
