"""Features computed once for training and serving (names as in Feast): definitions, a declared
repository, point-in-time-correct historical retrieval."""

from mlscale.features.definitions import (
    Entity,
    FeatureRepository,
    FeatureService,
    FeatureView,
    Field,
    FileSource,
    OnDemandFeatureView,
    on_demand_feature_view,
)
from mlscale.features.offline import get_historical_features
from mlscale.features.repository import declare_repository, load_repository, load_service

__all__ = ["Entity", "FeatureRepository", "FeatureService", "FeatureView", "Field", "FileSource",
           "OnDemandFeatureView", "declare_repository", "get_historical_features", "load_repository", "load_service",
           "on_demand_feature_view"]
