"""Between runs, the registry and runnable models: register a finished run, rebuild a version's model.

A version stores the plain weights (safetensors, no pickle; every state-dict name, ties recorded:
``mlscale.weights``) and the run's resolved configuration; the model is rebuilt from its task and the
verified weights are loaded into it, so a tie the model makes (a head sharing the embedding) is one
storage again. Whatever the model returns (a tensor, tuple, dict or ``ModelOutput``), what it is served
and exported as is its ``predictions`` tensor (``mlscale.tasks.outputs``), under the name ``output``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlscale.config import TrainConfig
from mlscale.dtypes import v2_datatype
from mlscale.errors import UsageError
from mlscale.registry.store import WEIGHTS_ARTIFACT, ModelVersion, Registry
from mlscale.rundir import RunDir
from mlscale.tasks import Task, make_task
from mlscale.tasks.outputs import predictions
from mlscale.weights import load_weights

WEIGHTS = WEIGHTS_ARTIFACT


def task_of(config: dict[str, Any]) -> Task:
    return make_task(config["task"], config.get("task_options") or {})


def signature_of(config: dict[str, Any], task: Task | None = None) -> dict[str, Any]:
    """Input and output tensors with a dynamic batch dimension (-1), in the Open Inference Protocol's
    datatype names; the output is the model's predictions tensor (one, named ``output``, whatever the
    model returns: every runtime and the ONNX export serve that one)."""
    task = task or task_of(config)
    model = build_model(config, task)
    dtype = getattr(torch, config.get("dtype", "float32"))
    sample = task.eval.to(dtype).inputs[:2]
    with torch.no_grad(), _embeddings_fed_by(model, sample) as rows:
        output = predictions(model(sample))
    spec: dict[str, Any] = {"name": "input", "datatype": v2_datatype(sample.dtype), "shape": [-1, *sample.shape[1:]]}
    if rows:  # token ids: the server refuses an id the embedding has no row for (400, not a failed call)
        spec["range"] = [0, min(rows) - 1]
    return {
        "inputs": [spec],
        "outputs": [{"name": "output", "datatype": v2_datatype(output.dtype), "shape": [-1, *output.shape[1:]]}],
    }


@contextmanager
def _embeddings_fed_by(model: nn.Module, sample: torch.Tensor) -> Iterator[list[int]]:
    """The row counts of the embeddings that look the model's input up (the same storage, as a model
    of ours or Hugging Face's passes its ids on, maybe reshaped), found during one forward pass."""
    rows: list[int] = []
    if sample.dtype.is_floating_point:
        yield rows
        return

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].data_ptr() == sample.data_ptr():
            rows.append(module.num_embeddings)

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Embedding)]
    try:
        yield rows
    finally:
        for hook in hooks:
            hook.remove()


def sample_request(version: ModelVersion, rows: int = 1, *, predict: bool = False) -> dict[str, Any]:
    """A request body the server accepts for this version: ``rows`` held-out inputs of its task, as an
    Open Inference Protocol v2 infer request or a ``/predict`` body."""
    spec = version.signature["inputs"][0]
    dtype = getattr(torch, version.config.get("dtype", "float32"))
    inputs = task_of(version.config).eval.to(dtype).inputs[:rows]  # floats cast, integer inputs kept
    if predict:
        return {"inputs": inputs.tolist()}
    return {"inputs": [{"name": spec["name"], "shape": list(inputs.shape), "datatype": spec["datatype"],
                        "data": inputs.flatten().tolist()}]}


def build_model(config: dict[str, Any], task: Task | None = None) -> nn.Module:
    task = task or task_of(config)
    model = task.build_model().to(getattr(torch, config.get("dtype", "float32")))
    return model.eval()


def load_torch_model(registry: Registry, version: ModelVersion) -> nn.Module:
    """The version's model in eval mode, from the weights' bytes verified against their SHA-256 (those
    very bytes: the file is not opened again after the check); its ties are one storage, as built."""
    return load_weights(build_model(version.config), registry.artifact_bytes(version, WEIGHTS))


def register_run(registry: Registry, run_dir: str | Path, name: str, *, description: str = "",
                 tags: dict[str, str] | None = None) -> ModelVersion:
    """Register the final model of a completed run, with its lineage; updates the run's ``model_uri``."""
    run = RunDir(run_dir)
    if not run.report_path.exists():
        raise UsageError(f"bad value run-dir={str(run_dir)!r}: no report.json (is it a training run directory?)")
    report = run.read_report()
    if report.get("status") != "completed":
        raise UsageError(f"bad value run-dir={str(run_dir)!r}: the run did not complete ({report.get('status')})")
    if not run.final_model_path.exists():
        raise UsageError(f"bad value run-dir={str(run_dir)!r}: final/{WEIGHTS} is missing")
    config = TrainConfig(**run.read_config()).flat()  # by flat names, as earlier versions were registered
    metrics = {"eval": report.get("eval", {}), "final_loss": report.get("final_loss"),
               "samples_per_s": report.get("samples_per_s"), "steps": report.get("steps"),
               "samples_seen": report.get("samples_seen"), "world_size": report.get("world_size"),
               "wall_s": report.get("wall_s"), "features": report.get("features")}
    version = registry.create_version(
        name, {WEIGHTS: run.final_model_path}, config=config, metrics=metrics, signature=signature_of(config),
        source_run=str(run.path.resolve()), data_fingerprint=report.get("data_fingerprint"),
        code_version=report.get("code_version") or {}, description=description, tags=tags)
    report["model_uri"] = version.uri
    run.write_report(report)
    return version
