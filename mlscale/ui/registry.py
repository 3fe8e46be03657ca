"""The registry, as the UI shows it: models with their stages and aliases; one model's versions with
each one's lineage (source run and whether it still holds this version's weights, data fingerprint,
features, ONNX parity) and its audit history. Read only: the UI never changes a row."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlscale.registry import ModelVersion, Registry
from mlscale.rundir import RunDir


class RegistryView:
    """``--registry``, opened once on first use (an existing registry only: the UI creates none)."""

    def __init__(self, location: str | None, run_id_of: Callable[[str | None], str | None]) -> None:
        self.location, self.run_id_of = location, run_id_of
        self._registry: Registry | None = None
        self._states: dict[tuple[str, str, float, int], str] = {}  # source-run check, by weights file state
        self._lock = threading.Lock()

    @property
    def registry(self) -> Registry:
        with self._lock:
            if self._registry is None:
                self._registry = Registry(self.location, create=False)
            return self._registry

    def models(self) -> list[dict[str, Any]]:
        return self.registry.list_models()

    def model(self, name: str) -> dict[str, Any]:
        registry = self.registry
        versions = registry.versions(name)
        return {"name": name, "tags": registry.model_tags(name),
                "versions": [self.version(v) for v in reversed(versions)], "history": registry.history(name)}

    def version(self, version: ModelVersion) -> dict[str, Any]:
        config = version.config
        artifacts = [{"name": a.name, "size_bytes": a.size_bytes, "sha256": a.sha256,
                      "parity": a.info.get("parity")} for a in version.artifacts.values()]
        features = version.metrics.get("features") if isinstance(version.metrics, dict) else None
        return {
            "uri": version.uri, "version": version.version, "stage": version.stage, "aliases": version.aliases,
            "description": version.description, "created_at": version.created_at, "created_by": version.created_by,
            "tags": version.tags, "metrics": {k: v for k, v in version.metrics.items() if k != "features"},
            "source_run": version.source_run, "source_run_state": self._source_state(version),
            "source_run_id": self.run_id_of(version.source_run),
            "data_fingerprint": version.data_fingerprint, "code_version": version.code_version,
            "features": features, "signature": version.signature, "artifacts": artifacts,
            "training": {key: config.get(key) for key in ("task", "strategy", "workers", "batch_size", "lr", "seed",
                                                          "dtype", "precision", "steps")},
        }

    def _source_state(self, version: ModelVersion) -> str:
        """verified / gone / changed, hashed again only when the run's weights file changed."""
        if not version.source_run:
            return version.source_run_state()
        weights = RunDir(version.source_run).final_model_path
        try:
            stat = weights.stat()
        except OSError:
            return version.source_run_state()
        key = (str(Path(weights).resolve()), version.uri, stat.st_mtime, stat.st_size)
        if key not in self._states:
            self._states[key] = version.source_run_state()
        return self._states[key]
