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

from mlscale.common.dtypes import v2_datatype
from mlscale.config import TrainConfig
from mlscale.data.batches import Tree, call_model
from mlscale.data.tensors import TensorData
from mlscale.errors import UsageError
from mlscale.registry.generation import generation_files
from mlscale.registry.inputs import SINGLE, call_args, named
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
    model returns: every runtime and the ONNX export serve that one).

    The inputs are named as ``mlscale.registry.inputs`` says (``input`` for a model of one tensor; a
    dict's keys; ``input_0, input_1, ...`` for a tuple). A held-out split in memory has one shape (only the
    batch varies); a held-out ``Dataset`` is collated one sample at a time, and every dimension whose size
    differs between samples (the sequence a collate pads) is -1 too, in the inputs and in the output."""
    task = task or task_of(config)
    model = build_model(config, task)
    dtype = getattr(torch, config.get("dtype", "float32"))
    if isinstance(task.eval, TensorData):  # one tensor of one shape: the signature every such model had
        sample, singles = task.eval.to(dtype).inputs[:2], []
    else:
        sample, singles = _held_out_samples(task, dtype)
    with torch.no_grad(), _embeddings_fed_by(model, named(sample)) as rows:
        output = predictions(call_model(model, sample))
    varying = _varying(singles)
    inputs = []
    for name, tensor in named(sample).items():
        spec: dict[str, Any] = {"name": name, "datatype": v2_datatype(tensor.dtype),
                                "shape": _shape(tensor, varying.get(name, set()))}
        if rows.get(name):  # token ids: the server refuses an id the embedding has no row for (400, not a failed call)
            spec["range"] = [0, min(rows[name]) - 1]
        inputs.append(spec)
    with torch.no_grad():
        outputs = [predictions(call_model(model, single)) for single in _extremes(singles)]
    return {
        "inputs": inputs,
        "outputs": [{"name": "output", "datatype": v2_datatype(output.dtype),
                     "shape": _shape(output, _varying([named(out) for out in outputs]).get(SINGLE, set()))}],
    }


def _held_out_samples(task: Task, dtype: torch.dtype) -> tuple[Tree, list[dict[str, torch.Tensor]]]:
    """Two held-out samples collated as one batch, and up to 16 samples collated alone (each as long as
    it is: what shows which dimensions vary)."""
    held_out = task.eval_data().to(dtype)
    sample = held_out.batch([0, 1] if len(held_out) > 1 else [0])[0]
    return sample, [named(held_out.batch([i])[0]) for i in range(min(len(held_out), 16))]


def _varying(samples: list[dict[str, torch.Tensor]]) -> dict[str, set[int]]:
    """Per input name, the dimensions past the batch whose size differs between ``samples``."""
    found: dict[str, set[int]] = {}
    for name in samples[0] if samples else ():
        shapes = {tuple(sample[name].shape) for sample in samples}
        found[name] = {dim for dim in range(1, len(next(iter(shapes)))) if len({s[dim] for s in shapes}) > 1}
    return found


def _extremes(samples: list[dict[str, torch.Tensor]]) -> list[Tree]:
    """The shortest and the longest of ``samples`` (by their first input's size), as model inputs."""
    if not samples:
        return []
    ordered = sorted(samples, key=lambda sample: next(iter(sample.values())).numel())
    return [_unnamed(ordered[0]), _unnamed(ordered[-1])]


def _unnamed(values: dict[str, torch.Tensor]) -> Tree:
    """Named inputs as the model is called with them again (a tuple, a dict or one tensor)."""
    args, kwargs = call_args(values)
    return kwargs if kwargs else (args[0] if list(values) == [SINGLE] else args)


def _shape(tensor: torch.Tensor, varying: set[int]) -> list[int]:
    return [-1, *(-1 if dim in varying else size for dim, size in enumerate(tensor.shape) if dim > 0)]


@contextmanager
def _embeddings_fed_by(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, list[int]]]:
    """Per integer input, the row counts of the embeddings that look it up (the same storage, as a model
    of ours or Hugging Face's passes its ids on, maybe reshaped), found during one forward pass."""
    rows: dict[str, list[int]] = {}
    owners = {tensor.data_ptr(): name for name, tensor in inputs.items()
              if isinstance(tensor, torch.Tensor) and not tensor.dtype.is_floating_point}
    if not owners:
        yield rows
        return

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].data_ptr() in owners:
            rows.setdefault(owners[args[0].data_ptr()], []).append(module.num_embeddings)

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Embedding)]
    try:
        yield rows
    finally:
        for hook in hooks:
            hook.remove()


def sample_request(version: ModelVersion, rows: int = 1, *, predict: bool = False) -> dict[str, Any]:
    """A request body the server accepts for this version: ``rows`` held-out inputs of its task, as an
    Open Inference Protocol v2 infer request (every input by name) or a ``/predict`` body (one input)."""
    dtype = getattr(torch, version.config.get("dtype", "float32"))
    task = task_of(version.config)
    if isinstance(task.eval, TensorData):
        inputs = {SINGLE: task.eval.to(dtype).inputs[:rows]}  # floats cast, integer inputs kept
    else:
        held_out = task.eval_data().to(dtype)
        inputs = named(held_out.batch([i % len(held_out) for i in range(rows)])[0])
    if predict:
        return {"inputs": inputs[SINGLE].tolist()}
    datatypes = {spec["name"]: spec["datatype"] for spec in version.signature["inputs"]}
    return {"inputs": [{"name": name, "shape": list(tensor.shape), "datatype": datatypes[name],
                        "data": tensor.flatten().tolist()} for name, tensor in inputs.items()]}


def build_model(config: dict[str, Any], task: Task | None = None) -> nn.Module:
    task = task or task_of(config)
    model = task.build_model().to(getattr(torch, config.get("dtype", "float32")))
    return model.eval()


def load_torch_model(registry: Registry, version: ModelVersion) -> nn.Module:
    """The version's model in eval mode, from the weights' bytes verified against their SHA-256 (those
    very bytes: the file is not opened again after the check); its ties are one storage, as built."""
    return load_weights(build_model(version.config), registry.artifact_bytes(version, WEIGHTS))


def register_run(registry: Registry, run_dir: str | Path, name: str, *, description: str = "",
                 tags: dict[str, str] | None = None, tokenizer: str | Path | None = None,
                 generation_config: str | Path | None = None) -> ModelVersion:
    """Register the final model of a completed run, with its lineage; updates the run's ``model_uri``.
    A language model may bring its ``tokenizer`` (tokenizer.json) and ``generation_config`` (sampling
    defaults, chat template), stored as artifacts of the version (``mlscale.registry.generation``)."""
    extra = generation_files(tokenizer, generation_config)  # checked before anything is stored
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
        name, {WEIGHTS: run.final_model_path, **extra}, config=config, metrics=metrics,
        signature=signature_of(config),
        source_run=str(run.path.resolve()), data_fingerprint=report.get("data_fingerprint"),
        code_version=report.get("code_version") or {}, description=description, tags=tags)
    report["model_uri"] = version.uri
    run.write_report(report)
    return version
