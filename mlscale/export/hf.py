"""Export a registered Hugging Face model as a folder ``from_pretrained(DIR)`` loads: its config and
its weights as the model's own ``save_pretrained`` writes them (safetensors, each tie stored once and
restored by ``from_pretrained``), plus ``mlscale.json`` naming the version it came from.

A model is taken as a Hugging Face one by what it can do (``save_pretrained`` and a ``config``), so
``transformers`` is imported only by the task that builds such a model, never here.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

from torch import nn

from mlscale.errors import UsageError
from mlscale.registry.models import WEIGHTS, load_torch_model
from mlscale.registry.store import Registry

LINEAGE_FILE = "mlscale.json"


def is_hugging_face_model(model: nn.Module) -> bool:
    return callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")


def export_hf(registry: Registry, uri: str, directory: str | Path) -> Path:
    """Write the version's model to ``directory`` (new or empty) for ``from_pretrained``; the folder
    appears whole or not at all (written beside it, then renamed)."""
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"bad value DIR={str(target)!r}: exists and is not an empty folder (an export "
                         "writes a new one)")
    version = registry.resolve(uri)
    model = load_torch_model(registry, version)
    if not is_hugging_face_model(model):
        raise UsageError(f"{version.uri} is a {type(model).__name__}, not a Hugging Face model (no "
                         "save_pretrained and config): --format hf is for those; use --format onnx")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar, on a one-line command
            model.save_pretrained(staging)
        lineage = {"model_uri": version.uri, "weights_sha256": version.artifacts[WEIGHTS].sha256,
                   "task": version.config["task"], "task_options": version.config.get("task_options") or {},
                   "class": f"{type(model).__module__}.{type(model).__qualname__}"}
        (staging / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2) + "\n")
        if target.exists():
            target.rmdir()  # empty, checked above
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
