"""A model's inputs by name: what the signature lists, the ONNX graph takes and a request carries.

A model called ``model(x)`` has one input, ``input`` (as every model had before several inputs were
served, so their signatures, exports and requests are unchanged). A model called ``model(**inputs)``
has one input per key, named by the key (a Hugging Face encoder's ``input_ids`` and
``attention_mask``). A model called ``model(*inputs)`` has one per position, named ``input_0``,
``input_1``, ...: a tuple has no names of its own, and a position's name must not change with the other
inputs. The names alone say how the model is called again (``call_args``), so nothing else is stored.

Pure Python: the server of an ONNX model (no torch) reads it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
SINGLE = "input"
_POSITION = re.compile(r"input_(\d+)")


def named(inputs: Any) -> dict[str, Any]:
    """The inputs of one call by name: a dict's keys, ``input_0, input_1, ...`` for a tuple's positions,
    ``input`` for a single tensor."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return {f"input_{i}": value for i, value in enumerate(inputs)}
    return {SINGLE: inputs}


def positional(names: Sequence[str]) -> bool:
    """Are these the names of positional inputs (``input``, or ``input_0 .. input_N`` in order)?"""
    if list(names) == [SINGLE]:
        return True
    return all((found := _POSITION.fullmatch(name)) is not None and int(found.group(1)) == i
               for i, name in enumerate(names))


def call_args(values: Mapping[str, T]) -> tuple[tuple[T, ...], dict[str, T]]:
    """The positional and keyword arguments a model whose inputs are ``values`` (by name, in the
    signature's order) is called with."""
    if positional(list(values)):
        return tuple(values.values()), {}
    return (), dict(values)


__all__ = ["SINGLE", "call_args", "named", "positional"]
