"""Serving a model trained from a feature service: a request names entities instead of sending a
tensor, and the server builds the tensor the way training did.

``{"parameters": {"entities": [{"user_id": 7}, ...]}}`` on ``/v2/models/NAME/infer`` (no
``inputs``), or ``{"entities": [...]}`` on ``/predict``: the service's features are looked up in the
online store by entity key (TTL at the request's time), the on-demand transformations run (the same
functions as at training), and the model's input is built by ``mlscale.features.encoding``, as the
``features`` task built it. ``"return_features": true`` in the parameters adds the vectors used to the answer.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mlscale.errors import UsageError
from mlscale.features.encoding import model_matrix
from mlscale.registry import ModelVersion
from mlscale.serve.protocol import MAX_ROWS, BadRequest


class FeatureInputs:
    """The feature vectors of entity rows, for one model version trained from features."""

    def __init__(self, version: ModelVersion, store_location: str | None, log_location: str | None = None) -> None:
        from mlscale.features import load_service
        from mlscale.features.online import online_store
        from mlscale.features.skew import FeatureLog, FeatureSkew

        options = version.config.get("task_options") or {}
        if store_location is None:
            raise UsageError(f"{version.uri} was trained from features ({options.get('service')}): give the online "
                             "store it reads them from with --online-store (a SQLite file or redis:// URL)")
        self.version = version
        self.repository, self.service = load_service(str(options.get("service")))
        self.store = online_store(store_location)
        self.fields = self.service.fields()
        self.names = [field.name for field in self.fields]
        recorded = version.metrics.get("features") or {}
        self.encoding = recorded.get("encoding") or {}  # the categories each categorical feature had
        self.skew = FeatureSkew(recorded.get("statistics") or {})  # /metrics, against the training statistics
        self.log = FeatureLog(log_location) if log_location else None

    def vectors(self, entity_rows: list[dict[str, Any]]) -> np.ndarray:
        from mlscale.features.online import get_online_features

        try:
            columns = get_online_features(self.repository, self.store, self.service, entity_rows)
        except UsageError as exc:  # an entity row without a join key: the client's mistake
            raise BadRequest(str(exc)) from None
        self.skew.observe(columns)  # the values as served, missing ones not counted (as at training)
        if self.log is not None:
            self.log.append(self.version.name, self.version.version, time.time(), columns)
        return model_matrix(columns, self.fields, self.encoding, len(entity_rows))


def entity_rows(value: Any) -> list[dict[str, Any]]:
    """The request's entities: a non-empty list of objects of join keys."""
    if not isinstance(value, list) or not value or not all(isinstance(row, dict) for row in value):
        raise BadRequest("'entities' must be a non-empty list of objects of entity keys, like [{\"user_id\": 7}]")
    if len(value) > MAX_ROWS:
        raise BadRequest(f"'entities' holds {len(value)} rows; at most {MAX_ROWS}")
    return value
