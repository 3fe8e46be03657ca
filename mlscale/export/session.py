"""An onnxruntime session on the CPU with a fixed thread count: what serving, the parity check and the
benchmarks run. Apart from the exporter so that serving an ONNX model never imports torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def onnx_session(model: str | Path | bytes, threads: int = 1) -> Any:
    """A session of the model at a path, or of the model's bytes: pass a registered artifact's verified
    bytes (``Registry.artifact_bytes``), so that what runs is what was hashed."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    source = bytes(model) if isinstance(model, (bytes, bytearray, memoryview)) else str(model)
    return ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
