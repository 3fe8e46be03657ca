"""The model registry: versions, stages, aliases, tags, lineage, verified artifacts, model URIs."""

from mlscale.registry.artifacts import ArtifactIntegrityError, ArtifactStore, LocalArtifactStore
from mlscale.registry.models import load_torch_model, register_run
from mlscale.registry.store import ModelVersion, NotFound, Registry, RegistryError
from mlscale.registry.uri import STAGES, ModelURI, parse_uri

__all__ = ["STAGES", "ArtifactIntegrityError", "ArtifactStore", "LocalArtifactStore", "ModelURI", "ModelVersion",
           "NotFound", "Registry", "RegistryError", "load_torch_model", "parse_uri", "register_run"]
