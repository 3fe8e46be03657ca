"""The serving runtimes, named once. Each entry is read by everything that names a runtime:
``ServeOptions.runtime`` and ``mlscale serve --runtime`` (``RUNTIME_CHOICES``), ``load_runtime`` (below: the
loader), ``ServedModel`` (the artifact it executes, whose hash starts the cache key) and ``describe``
(the Triton platform and backend that model metadata and model config report).

Nothing heavy is imported here (numpy, torch, onnxruntime): the options model, and so ``mlscale serve
--help``, reads this table. A runtime's code is imported by its loader, when a model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mlscale.errors import UsageError

if TYPE_CHECKING:
    from mlscale.registry import ModelVersion, Registry
    from mlscale.serve.runtime import Runtime

# (registry, version, threads, datatype: None as trained, or FP16 / BF16) -> the loaded runtime
Loader = Callable[["Registry", "ModelVersion", int, "str | None"], "Runtime"]


@dataclass(frozen=True)
class RuntimeKind:
    kind: str  # --runtime's value and the runtime's ``kind``
    artifact: str  # the registered file it executes
    platform: str  # Triton's platform name
    backend: str  # Triton's backend name
    load: Loader
    reduced_precision: bool  # serves --precision fp16|bf16


def _load_onnx(registry: Registry, version: ModelVersion, threads: int, datatype: str | None) -> Runtime:
    from mlscale.serve.runtime import OnnxRuntime

    if ONNX.artifact not in version.artifacts:
        raise UsageError(f"{version.uri} has no ONNX artifact: run `mlscale export {version.uri}` first, "
                         "or serve with --runtime torch")
    return OnnxRuntime(registry.artifact_bytes(version, ONNX.artifact), threads)


def _load_torch(registry: Registry, version: ModelVersion, threads: int, datatype: str | None) -> Runtime:
    from mlscale.registry import load_torch_model
    from mlscale.serve.runtime import TorchRuntime

    return TorchRuntime(load_torch_model(registry, version), threads, datatype=datatype)


ONNX = RuntimeKind("onnx", "model.onnx", "onnxruntime_onnx", "onnxruntime", _load_onnx, reduced_precision=False)
TORCH = RuntimeKind("torch", "model.safetensors", "pytorch_libtorch", "pytorch", _load_torch,
                    reduced_precision=True)
# In the order ``auto`` prefers them: the first whose artifact the version has and that serves the
# precision asked for (onnxruntime when the version has an ONNX export, else torch).
RUNTIMES = {runtime.kind: runtime for runtime in (ONNX, TORCH)}
AUTO = "auto"
RUNTIME_CHOICES = (AUTO, *RUNTIMES)
RuntimeChoice = Literal[RUNTIME_CHOICES]  # ServeOptions.runtime: Literal["auto", "onnx", "torch"]


def choose(kind: str, artifacts: Collection[str], precision: str = "as-trained") -> RuntimeKind:
    """The runtime ``kind`` names, or the one ``auto`` picks for a version with these artifacts; a
    ``UsageError`` for an unknown kind, or for one that cannot serve the reduced precision asked for."""
    if kind not in RUNTIME_CHOICES:
        raise UsageError(f"bad value runtime={kind!r}: must be {', '.join(RUNTIME_CHOICES[:-1])} or "
                         f"{RUNTIME_CHOICES[-1]}")
    reduced = precision != "as-trained"
    able = [runtime for runtime in RUNTIMES.values() if runtime.reduced_precision or not reduced]
    if kind != AUTO:
        if RUNTIMES[kind] not in able:
            names = " or ".join(runtime.kind for runtime in able)
            raise UsageError(f"bad value precision={precision!r}: reduced-precision serving runs on the {names} "
                             f"runtime (--runtime {names} or auto)")
        return RUNTIMES[kind]
    # none has its artifact: the last able one, whose loader says what is missing
    return next((runtime for runtime in able if runtime.artifact in artifacts), able[-1])


PRECISIONS = {"fp16": "FP16", "bf16": "BF16"}


def load_runtime(registry: Registry, version: ModelVersion, kind: str = "auto", threads: int = 1,
                 precision: str = "as-trained") -> Runtime:
    """The runtime ``kind`` names (or ``auto`` picks), loaded: see ``RUNTIMES``."""
    runtime = choose(kind, version.artifacts, precision)
    return runtime.load(registry, version, threads, PRECISIONS.get(precision))
