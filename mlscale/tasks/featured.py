"""The ``features`` task: train on a feature service's point-in-time training set.

``mlscale train --features package.module:SERVICE --entities entities.parquet [--label label]``
builds the training set by historical retrieval: one row per entity row (its join keys, its event
time and its label), the service's features as of that time. The held-out split is the latest
``eval_fraction`` of the rows by event time (a model is judged on times after those it learned
from). A missing value (no row inside the TTL) enters the model as 0, a categorical feature as one 0/1
column per category seen in training (``mlscale.features.encoding``). The feature list and each
feature's training statistics (the distribution the server's skew check compares with) go into the
task's info, the run's report and the registered version's lineage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from mlscale.errors import UsageError
from mlscale.features import get_historical_features, load_service
from mlscale.features.encoding import categories_of, category, is_categorical, model_matrix
from mlscale.tasks.base import Task, TensorData, regression_metrics
from mlscale.tasks.tabular import TabularMLP

HISTOGRAM_BINS = 10


def numeric_statistics(values: np.ndarray) -> dict[str, Any]:
    """What a feature's training values looked like: moments, range, missing share and a histogram
    over bins of equal width between the 1st and 99th percentiles (the outer bins open-ended)."""
    present = values[~np.isnan(values)]
    if len(present) == 0:
        return {"kind": "numeric", "count": len(values), "null_fraction": 1.0}
    low, high = np.percentile(present, [1, 99])
    inner = np.linspace(low, high, HISTOGRAM_BINS - 1) if high > low else np.array([low])
    counts = np.bincount(np.searchsorted(inner, present, side="right"), minlength=len(inner) + 1)
    return {"kind": "numeric", "count": len(values), "null_fraction": float(1 - len(present) / len(values)),
            "mean": float(present.mean()), "std": float(present.std()), "min": float(present.min()),
            "max": float(present.max()), "edges": [float(e) for e in inner], "counts": [int(c) for c in counts]}


def categorical_statistics(values: list[Any]) -> dict[str, Any]:
    """A categorical feature's training values: how often each category came, and the missing share."""
    frequencies: dict[str, int] = {}
    for value in values:
        name = category(value)
        if name is not None:
            frequencies[name] = frequencies.get(name, 0) + 1
    present = sum(frequencies.values())
    return {"kind": "categorical", "count": len(values),
            "null_fraction": float(1 - present / len(values)) if values else 0.0, "frequencies": frequencies}


def make_features(service: str = "", entities: str = "", label: str = "label", timestamp: str = "event_timestamp",
                  hidden: int = 64, eval_fraction: float = 0.2) -> Task:
    if not service or not entities:
        raise UsageError("training from features needs --features package.module:SERVICE and --entities FILE")
    repository, feature_service = load_service(service)
    table = get_historical_features(repository, entities, feature_service, timestamp_field=timestamp)
    if label not in table.column_names:
        raise UsageError(f"bad value label={label!r}: the entity rows have no such column "
                         f"(columns: {', '.join(table.column_names)})")
    fields = feature_service.fields()
    names = [field.name for field in fields]
    columns: dict[str, Any] = {}
    for field in fields:
        column = table.column(field.name)
        if is_categorical(field):
            columns[field.name] = column.to_pylist()
            continue
        try:
            columns[field.name] = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
        except (TypeError, ValueError):
            raise UsageError(f"feature {field.name!r} of service {feature_service.name!r} holds values that are not "
                             f"numbers; declare it Field({field.name!r}, 'string') to train on it as a category") \
                from None
    order = np.argsort(table.column(timestamp).to_numpy(), kind="stable")  # by event time: the latest held out
    held = max(1, round(len(order) * eval_fraction))
    if len(order) - held < 1:
        raise UsageError(f"bad value entities={entities!r}: {len(order)} row(s) leave nothing to train on")
    train_rows, eval_rows = order[:-held], order[-held:]
    statistics, encoding = {}, {}
    for field in fields:
        values = columns[field.name]
        if is_categorical(field):
            training = [values[i] for i in train_rows]
            encoding[field.name] = categories_of(training)
            statistics[field.name] = categorical_statistics(training)
        else:
            statistics[field.name] = numeric_statistics(values[train_rows])
        if field.skew_threshold is not None:  # the alarm level declared with the feature travels with it
            statistics[field.name]["skew_threshold"] = field.skew_threshold
    inputs = torch.from_numpy(model_matrix(columns, fields, encoding, len(table)))
    labels = table.column(label).to_numpy(zero_copy_only=False)
    classify = np.issubdtype(labels.dtype, np.integer)
    targets = torch.from_numpy(labels.astype(np.int64 if classify else np.float32))
    split = [TensorData(inputs[rows], targets[rows]) for rows in (train_rows, eval_rows)]
    info = {"features": {"service": service, "features": names, "statistics": statistics, "encoding": encoding,
                         "training_rows": len(train_rows), "held_out_rows": len(eval_rows)}}
    width = inputs.shape[1]
    if classify:
        classes = int(labels.max()) + 1
        return Task("features", lambda: TabularMLP(width, classes, hidden), split[0], split[1], info=info)
    return Task("features", lambda: TabularMLP(width, 1, hidden, scalar=True), split[0], split[1],
                loss_fn=nn.functional.mse_loss, metrics_fn=regression_metrics, info=info)
