"""Model export: ONNX with a parity check against PyTorch.

The exporter needs torch; ``mlscale.export.session`` (the onnxruntime session that serving uses) does
not, so the exporter's names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlscale.common.lazy import lazy_names

if TYPE_CHECKING:
    from mlscale.export.onnx import ATOL, RTOL, ExportError, Parity, check_parity, export_onnx, export_version

__all__ = ["ATOL", "RTOL", "ExportError", "Parity", "check_parity", "export_onnx", "export_version"]

__getattr__, __dir__ = lazy_names(__name__, {name: "mlscale.export.onnx" for name in __all__})
