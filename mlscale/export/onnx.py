"""ONNX export with the torch.export-based exporter, checked against PyTorch with onnxruntime.

The exported graph's inputs are the registered signature's (``mlscale.registry.inputs``): one,
``input``, for a model of one tensor; a dict's keys or ``input_0, input_1, ...`` for a model of several.
Every dimension the signature leaves open (-1) is dynamic in the graph: the batch (``batch``) and, for
a task whose held-out samples differ in length, the sequence (``sequence``: one axis shared by every
input, as a padded batch has it). The one output, ``output``, has a dynamic batch dimension (and
sequence, when the predictions have one). ``output`` is the model's predictions tensor whatever the
model returns (a tensor; a tuple, dict or Hugging Face ``ModelOutput``: its ``logits``, else its first
tensor; ``mlscale.tasks.outputs``), the same tensor the torch runtime serves, so a client (Triton-style:
outputs asked for by the names the model metadata lists) sees one signature for both runtimes. The
model's other outputs are not exported.
Weights that are one tensor in the model (a tied head) are one initializer in the graph.

Parity is checked on held-out inputs in several batch sizes (1, 7, 64 and the rest), so the dynamic
dimension is exercised (a held-out ``Dataset`` is collated per batch, so the batches also differ in
sequence length); an export whose outputs differ beyond ``rtol`` / ``atol`` (numpy.allclose's rule)
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
from typing import Any

import numpy as np
import torch
from torch import nn

from mlscale.data.batches import Tree, rows, take
from mlscale.data.tensors import TensorData
from mlscale.errors import MlscaleError
from mlscale.export.session import onnx_session
from mlscale.registry.inputs import call_args, named
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
    """``model`` returning only its predictions tensor: what is exported and checked. Its inputs are
    positional, in the signature's order; ``names`` say how the model takes them (by keyword for a
    dict's keys, else by position)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...] = ("input",)) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        args, kwargs = call_args(dict(zip(self.names, inputs)))
        return predictions(self.model(*args, **kwargs))


def dynamic_axes(signature: dict[str, Any] | None, names: list[str]) -> dict[str, list[int]]:
    """Per input (and ``output``), the dimensions the signature leaves open; without one, the batch."""
    if signature is None:
        return {name: [0] for name in [*names, "output"]}
    return {spec["name"]: [dim for dim, size in enumerate(spec["shape"]) if size == -1]
            for spec in [*signature["inputs"], *signature["outputs"]]}


def _dims(axes: list[int]) -> dict[int, Any]:
    """torch.export's dimensions of one input: one ``Dim`` per axis, shared by every input (a padded
    batch's inputs have one batch size and one sequence length)."""
    names = {0: "batch", 1: "sequence"}
    return {axis: torch.export.Dim(names.get(axis, f"dim{axis}"), min=1) for axis in axes}


def export_onnx(model: nn.Module, sample: Tree, path: Path, signature: dict[str, Any] | None = None) -> None:
    """Export ``model`` (in eval mode) to ``path`` with the inputs of ``sample`` by name (one tensor:
    ``input``), output ``output`` (its predictions tensor), and the dynamic dimensions ``signature``
    leaves open (without one: the batch)."""
    inputs = named(sample)
    axes = dynamic_axes(signature, list(inputs))
    shared = _dims(sorted({axis for name in inputs for axis in axes.get(name, [0])}))
    shapes = tuple({axis: shared[axis] for axis in axes.get(name, [0])} for name in inputs)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(Predictions(model, tuple(inputs)).eval(), tuple(inputs.values()), dynamo=True,
                                        input_names=list(inputs), output_names=["output"], dynamic_shapes=(shapes,),
                                        verbose=False)
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


def _parts(total: int) -> list[slice]:
    """``total`` rows in consecutive batches of 1, 7, 64 and the rest."""
    ends = np.cumsum(_batches(total)).tolist()
    return [slice(start, end) for start, end in zip([0, *ends], ends)]


def held_out_batches(version: ModelVersion, dtype: torch.dtype, samples: int) -> list[Tree]:
    """Up to ``samples`` held-out inputs of the version's task in batches of 1, 7, 64 and the rest; a
    held-out ``Dataset`` collated batch by batch (each padded to its own longest sample)."""
    task = task_of(version.config)
    if isinstance(task.eval, TensorData):
        inputs = task.eval.to(dtype).inputs[:samples]
        return [inputs[part] for part in _parts(len(inputs))]
    held_out = task.eval_data().to(dtype)
    return [held_out.batch(range(len(held_out))[part])[0] for part in _parts(min(samples, len(held_out)))]


def check_parity(model: nn.Module, path: Path | bytes, inputs: torch.Tensor | list[Tree], rtol: float = RTOL,
                 atol: float = ATOL) -> Parity:
    """The exported model's outputs against PyTorch's: ``inputs`` one tensor (checked in batches of 1, 7,
    64 and the rest) or a list of batches, each a model's inputs (a tensor, a tuple or a dict)."""
    if isinstance(inputs, torch.Tensor):
        inputs = [inputs[part] for part in _parts(len(inputs))]
    session = onnx_session(path)
    abs_err, rel_err, passed = 0.0, 0.0, True
    with torch.no_grad():
        for batch in inputs:
            values = named(batch)
            args, kwargs = call_args(values)
            expected = predictions(model(*args, **kwargs)).numpy()
            actual = session.run(["output"], {name: tensor.numpy() for name, tensor in values.items()})[0]
            diff = np.abs(actual - expected)
            abs_err = max(abs_err, float(diff.max()))
            significant = np.abs(expected) > atol
            if significant.any():
                rel_err = max(rel_err, float((diff[significant] / np.abs(expected[significant])).max()))
            passed &= bool(np.allclose(actual, expected, rtol=rtol, atol=atol))
    sizes = [rows(batch) for batch in inputs]
    return Parity(abs_err, rel_err, rtol, atol, sum(sizes), sizes, passed)


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
    held_out = held_out_batches(version, next(model.parameters()).dtype, samples)
    parity = check_parity(model, path, held_out, rtol=rtol, atol=atol)
    if not parity.passed:
        raise ExportError(f"the stored ONNX export of {version.uri} differs from PyTorch beyond rtol {rtol:g}, "
                          f"atol {atol:g} (max abs error {parity.max_abs_err:.3g}); a version's files are "
                          "write-once: register a new version to export again")
    return stored, parity


def _example(held_out: list[Tree]) -> Tree:
    """What the model is traced on: the first two held-out rows (a batch of one would fix the batch size),
    from the first batch that has two."""
    if isinstance(held_out[0], torch.Tensor):
        return torch.cat(held_out)[:2]
    return take(next((batch for batch in held_out if rows(batch) > 1), held_out[0]), slice(0, 2))


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
    held_out = held_out_batches(version, next(model.parameters()).dtype, samples)
    with tempfile.TemporaryDirectory(prefix="mlscale-onnx-") as tmp:
        path = Path(tmp) / ONNX_ARTIFACT
        export_onnx(model, _example(held_out), path, version.signature)
        parity = check_parity(model, path, held_out, rtol=rtol, atol=atol)
        if not parity.passed:
            raise ExportError(f"ONNX outputs differ from PyTorch for {version.uri}: max abs error "
                              f"{parity.max_abs_err:.3g}, max rel error {parity.max_rel_err:.3g} (allowed: rtol "
                              f"{parity.rtol:g}, atol {parity.atol:g}); nothing was stored")
        info = {"parity": asdict(parity), "exporter": "torch.onnx.export(dynamo=True)", "torch": torch.__version__,
                "onnxruntime": onnxruntime.__version__,
                "dynamic_axes": dynamic_axes(version.signature, [spec["name"] for spec in version.signature["inputs"]])}
        artifact = registry.add_artifact(version.name, version.version, ONNX_ARTIFACT, path, info)
    return artifact, parity
