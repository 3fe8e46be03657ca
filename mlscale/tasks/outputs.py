"""What a model returns, whatever its shape: a tensor, a tuple, a dict or a Hugging Face ``ModelOutput``.

The task's loss and metrics take the model's output as it is; the rest of mlscale only needs to put
outputs of several batches together (evaluation) and to find the tensor a client is served (the
predictions). Both work on the output's pytree (``ModelOutput`` registers itself as one), so no model
library is imported here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

# What a model's output calls its predictions, in the order they are looked for (Hugging Face, then common
# names); without one of them the first tensor of the output is its predictions.
PREDICTION_NAMES = ("logits", "predictions", "prediction", "output", "outputs", "last_hidden_state")


def concat(outputs: list[Any]) -> Any:
    """The outputs of consecutive batches as one output of the whole: every tensor with a batch dimension
    concatenated along it, in the structure of the first output."""
    if not outputs:
        raise ValueError("no outputs to concatenate")
    flat = [pytree.tree_flatten(output) for output in outputs]
    leaves, spec = flat[0]
    joined = []
    for position, first in enumerate(leaves):
        parts = [leaves_of[position] for leaves_of, _ in flat]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            joined.append(torch.cat(parts))
        else:
            joined.append(first)
    return pytree.tree_unflatten(joined, spec)


def to_cpu(output: Any) -> Any:
    return pytree.tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, output)


def predictions(output: Any) -> torch.Tensor:
    """The tensor a model's output holds its predictions in: the output itself when it is a tensor,
    else its ``logits`` (or another of ``PREDICTION_NAMES``), else its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    for name in PREDICTION_NAMES:
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise TypeError(f"the model returned {type(output).__name__} holding no tensor")
    return leaves[0]
