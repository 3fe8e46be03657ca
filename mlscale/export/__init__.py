"""Model export: ONNX with a parity check against PyTorch."""

from mlscale.export.onnx import ATOL, RTOL, ExportError, Parity, check_parity, export_onnx, export_version

__all__ = ["ATOL", "RTOL", "ExportError", "Parity", "check_parity", "export_onnx", "export_version"]
