"""The model registry: versions, stages, aliases, tags, lineage, verified artifacts, model URIs.

``load_torch_model`` and ``register_run`` need torch and are imported on first use, so a server of
ONNX models (which resolves URIs and fetches artifacts here) never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlscale.common.lazy import lazy_names
from mlscale.registry.artifacts import ArtifactIntegrityError, ArtifactStore, LocalArtifactStore
from mlscale.registry.store import ModelVersion, NotFound, Registry, RegistryError
from mlscale.registry.uri import STAGES, ModelURI, parse_uri

if TYPE_CHECKING:
    from mlscale.registry.models import load_torch_model, register_run

__all__ = ["STAGES", "ArtifactIntegrityError", "ArtifactStore", "LocalArtifactStore", "ModelURI", "ModelVersion",
           "NotFound", "Registry", "RegistryError", "load_torch_model", "parse_uri", "register_run"]

__getattr__, __dir__ = lazy_names(__name__, {name: "mlscale.registry.models"
                                             for name in ("load_torch_model", "register_run")})
