"""An onnxruntime session on the CPU with a fixed thread count: what serving, the parity check and the
benchmarks run. Apart from the exporter so that serving an ONNX model never imports torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def onnx_session(path: str | Path, threads: int = 1) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
