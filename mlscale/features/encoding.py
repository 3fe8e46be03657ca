"""What a model trained from features takes, built the same way at training and at serving: a
numeric feature as it is (a missing value as 0), a categorical one (``string`` or ``bool``) as one
0/1 column per category seen in training, in sorted order (a missing or unseen value: all 0)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mlscale.features.definitions import Field, feature_column

CATEGORICAL = ("string", "bool")


def is_categorical(field: Field) -> bool:
    return field.dtype in CATEGORICAL


def category(value: Any) -> str | None:
    """A categorical value as the encoding and the statistics name it."""
    return None if value is None else str(value)


def categories_of(values: Sequence[Any]) -> list[str]:
    return sorted({c for c in map(category, values) if c is not None})


def model_matrix(columns: Mapping[str, Sequence[Any]], fields: Sequence[Field],
                 encoding: Mapping[str, Sequence[str]], rows: int) -> np.ndarray:
    """The float32 input matrix of ``rows`` rows from each field's column of values."""
    blocks = []
    for field in fields:
        values = columns[field.name]
        if is_categorical(field):
            known = {c: i for i, c in enumerate(encoding.get(field.name, ()))}
            block = np.zeros((rows, len(known)), dtype=np.float32)
            for row, value in enumerate(values):
                index = known.get(category(value))  # type: ignore[arg-type]
                if index is not None:
                    block[row, index] = 1.0
        else:
            numbers = values if isinstance(values, np.ndarray) and values.dtype == np.float64 \
                else feature_column(list(values), "float64")
            block = np.nan_to_num(np.asarray(numbers, dtype=np.float64), nan=0.0).astype(np.float32)[:, None]
        blocks.append(block)
    return np.concatenate(blocks, axis=1) if blocks else np.zeros((rows, 0), dtype=np.float32)
