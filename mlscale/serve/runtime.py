"""Runtimes: what executes a batch. The server only knows this interface, not how a model was trained.

``onnx`` (onnxruntime, the default when the version has an ONNX artifact) and ``torch`` (eager, in
inference mode). Both take and return numpy arrays whose first dimension is the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from mlscale.dtypes import V2_TO_NAME
from mlscale.errors import UsageError
from mlscale.registry import ModelVersion, Registry

V2_TO_NUMPY = {v2: np.dtype(name) for v2, name in V2_TO_NAME.items() if v2 != "BF16"}
NUMPY_TO_V2 = {dtype: v2 for v2, dtype in V2_TO_NUMPY.items()}


class Runtime(Protocol):
    kind: str

    def run(self, batch: np.ndarray) -> np.ndarray: ...


class OnnxRuntime:
    kind = "onnx"

    def __init__(self, path: str, threads: int = 1) -> None:
        from mlscale.export.session import onnx_session

        self.session = onnx_session(path, threads=threads)

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(["output"], {"input": batch})[0]


class TorchRuntime:
    kind = "torch"

    def __init__(self, model: object, threads: int = 1) -> None:
        import torch

        torch.set_num_threads(threads)
        self.model, self._torch = model, torch

    def run(self, batch: np.ndarray) -> np.ndarray:
        with self._torch.inference_mode():
            return self.model(self._torch.from_numpy(batch)).numpy()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for the batch dimension

    @cached_property  # read on every request
    def dtype(self) -> np.dtype:
        return V2_TO_NUMPY[self.datatype]


def load_runtime(registry: Registry, version: ModelVersion, kind: str = "auto", threads: int = 1) -> Runtime:
    if kind not in ("auto", "onnx", "torch"):
        raise UsageError(f"bad value runtime={kind!r}: must be auto, onnx or torch")
    if kind == "onnx" or (kind == "auto" and "model.onnx" in version.artifacts):
        if "model.onnx" not in version.artifacts:
            raise UsageError(f"{version.uri} has no ONNX artifact: run `mlscale export {version.uri}` first, "
                             "or serve with --runtime torch")
        return OnnxRuntime(str(registry.artifact_path(version, "model.onnx")), threads)
    from mlscale.registry import load_torch_model

    return TorchRuntime(load_torch_model(registry, version), threads)
