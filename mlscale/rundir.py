"""The run directory (its layout is a contract: docs/architecture.md): the one writer and reader of
config.json, metrics.jsonl, final weights and report.json, so every part reads the same layout.

It lives outside ``train`` because training writes it and others (the registry, plots, the demo) read
it: a lower part never imports a higher one. Torch is needed only to write the final weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlscale.io import append_jsonl, atomic_write, atomic_write_json, read_jsonl

if TYPE_CHECKING:
    from torch import nn


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    config_path = property(lambda self: self.path / "config.json")
    plan_path = property(lambda self: self.path / "plan.json")  # the job plan (mlscale.train.plan)
    metrics_path = property(lambda self: self.path / "metrics.jsonl")
    report_path = property(lambda self: self.path / "report.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    logs = property(lambda self: self.path / "logs")
    final_model_path = property(lambda self: self.path / "final" / "model.safetensors")

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_json(self.config_path, config)

    def read_config(self) -> dict[str, Any]:
        return json.loads(self.config_path.read_text())

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl; a line torn by a killed run is cut off first (a resumed run)."""
        append_jsonl(self.metrics_path, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records; a torn last line (a run killed while writing it) is skipped."""
        return read_jsonl(self.metrics_path)

    def write_final_model(self, model: nn.Module, metadata: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
        atomic_write(self.final_model_path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    def write_report(self, report: dict[str, Any]) -> None:
        atomic_write_json(self.report_path, report)

    def read_report(self) -> dict[str, Any]:
        return json.loads(self.report_path.read_text())
