"""ONNX export with the torch.export-based exporter, checked against PyTorch with onnxruntime.

The exported graph has one input, ``input``, and one output, ``output``, both with a dynamic batch
dimension. ``output`` is the model's predictions tensor whatever the model returns (a tensor; a tuple,
dict or Hugging Face ``ModelOutput``: its ``logits``, else its first tensor; ``mlscale.tasks.outputs``),
the same tensor the torch runtime serves, so a client (Triton-style: outputs asked for by the names the
model metadata lists) sees one signature for both runtimes. The model's other outputs are not exported.
Weights that are one tensor in the model (a tied head) are one initializer in the graph.

Parity is checked on held-out inputs in several batch sizes (1, 7, 64 and the rest), so the dynamic
dimension is exercised; an export whose outputs differ beyond ``rtol`` / ``atol`` (numpy.allclose's rule)
fails loudly and stores nothing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mlscale.errors import MlscaleError
from mlscale.export.session import onnx_session
from mlscale.registry.models import load_torch_model, task_of
from mlscale.registry.store import Artifact, ModelVersion, Registry
from mlscale.tasks.outputs import predictions

RTOL, ATOL = 1e-4, 1e-5
ONNX_ARTIFACT = "model.onnx"


class ExportError(MlscaleError):
    """The export failed or its outputs do not match PyTorch's."""


@dataclass
class Parity:
    max_abs_err: float
    max_rel_err: float
    rtol: float
    atol: float
    samples: int
    batch_sizes: list[int]
    passed: bool


class Predictions(nn.Module):
    """``model`` returning only its predictions tensor: what is exported and checked."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return predictions(self.model(inputs))


def export_onnx(model: nn.Module, sample: torch.Tensor, path: Path) -> None:
    """Export ``model`` (in eval mode) to ``path`` with input ``input``, output ``output`` (its
    predictions tensor), dynamic batch."""
    batch = torch.export.Dim("batch", min=1)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(Predictions(model).eval(), (sample,), dynamo=True, input_names=["input"],
                                        output_names=["output"], dynamic_shapes=({0: batch},), verbose=False)
        except Exception as exc:
            raise ExportError(f"ONNX export failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    program.save(str(path))


def _batches(total: int) -> list[int]:
    sizes, left = [], total
    for size in (1, 7, 64):
        if left <= 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes + ([left] if left > 0 else [])


def check_parity(model: nn.Module, path: Path | bytes, inputs: torch.Tensor, rtol: float = RTOL,
                 atol: float = ATOL) -> Parity:
    session = onnx_session(path)
    sizes, start, abs_err, rel_err, passed = _batches(len(inputs)), 0, 0.0, 0.0, True
    with torch.no_grad():
        for size in sizes:
            batch = inputs[start:start + size]
            start += size
            expected = predictions(model(batch)).numpy()
            actual = session.run(["output"], {"input": batch.numpy()})[0]
            diff = np.abs(actual - expected)
            abs_err = max(abs_err, float(diff.max()))
            significant = np.abs(expected) > atol
            if significant.any():
                rel_err = max(rel_err, float((diff[significant] / np.abs(expected[significant])).max()))
            passed &= bool(np.allclose(actual, expected, rtol=rtol, atol=atol))
    return Parity(abs_err, rel_err, rtol, atol, len(inputs), sizes, passed)


def _stored_export(registry: Registry, version: ModelVersion, samples: int, rtol: float,
                   atol: float) -> tuple[Artifact, Parity]:
    """The version's stored ``model.onnx`` (verified) and its recorded parity; asked for other
    tolerances than it was checked with, the stored file is checked again against them (nothing is
    rewritten: a version's files are write-once)."""
    path = registry.artifact_bytes(version, ONNX_ARTIFACT)  # verified: what is checked is what was hashed
    stored = version.artifacts[ONNX_ARTIFACT]
    parity = Parity(**stored.info["parity"])
    if (parity.rtol, parity.atol) == (rtol, atol):
        return stored, parity
    model = load_torch_model(registry, version)
    held_out = task_of(version.config).eval.to(next(model.parameters()).dtype).inputs[:samples]
    parity = check_parity(model, path, held_out, rtol=rtol, atol=atol)
    if not parity.passed:
        raise ExportError(f"the stored ONNX export of {version.uri} differs from PyTorch beyond rtol {rtol:g}, "
                          f"atol {atol:g} (max abs error {parity.max_abs_err:.3g}); a version's files are "
                          "write-once: register a new version to export again")
    return stored, parity


def export_version(registry: Registry, uri: str, *, samples: int = 256, rtol: float = RTOL,
                   atol: float = ATOL) -> tuple[Artifact, Parity]:
    """Export a registered version to ONNX, check parity, store ``model.onnx`` in the same version.

    A version's files are write-once: a version that already has ``model.onnx`` is not exported again;
    its stored artifact (verified against its SHA-256) and the parity recorded with it are returned."""
    import onnxruntime

    version = registry.resolve(uri)
    if ONNX_ARTIFACT in version.artifacts:
        return _stored_export(registry, version, samples, rtol, atol)
    model = load_torch_model(registry, version)
    held_out = task_of(version.config).eval.to(next(model.parameters()).dtype).inputs[:samples]
    with tempfile.TemporaryDirectory(prefix="mlscale-onnx-") as tmp:
        path = Path(tmp) / ONNX_ARTIFACT
        export_onnx(model, held_out[:2], path)
        parity = check_parity(model, path, held_out, rtol=rtol, atol=atol)
        if not parity.passed:
            raise ExportError(f"ONNX outputs differ from PyTorch for {version.uri}: max abs error "
                              f"{parity.max_abs_err:.3g}, max rel error {parity.max_rel_err:.3g} (allowed: rtol "
                              f"{parity.rtol:g}, atol {parity.atol:g}); nothing was stored")
        info = {"parity": asdict(parity), "exporter": "torch.onnx.export(dynamo=True)", "torch": torch.__version__,
                "onnxruntime": onnxruntime.__version__, "dynamic_axes": {"input": [0], "output": [0]}}
        artifact = registry.add_artifact(version.name, version.version, ONNX_ARTIFACT, path, info)
    return artifact, parity
