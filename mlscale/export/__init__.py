"""Model export: ONNX with a parity check against PyTorch.

The exporter needs torch; ``mlscale.export.session`` (the onnxruntime session that serving uses) does
not, so the exporter's names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlscale.export.onnx import ATOL, RTOL, ExportError, Parity, check_parity, export_onnx, export_version

__all__ = ["ATOL", "RTOL", "ExportError", "Parity", "check_parity", "export_onnx", "export_version"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("mlscale.export.onnx"), name)
