"""A batch's inputs and targets whatever their shape: a tensor, a tuple of tensors or a dict of tensors.

A model takes one input tensor (``model(x)``), several in order (``model(*inputs)``) or by name
(``model(**inputs)``, a Hugging Face encoder's ``input_ids`` and ``attention_mask``). Everything that
moves a batch (to a device, to the run's dtype, into micro-steps or microbatches, into rows of a
sample cache) works on its pytree, so the loop and the strategies never ask which of these it is.
Every tensor of a batch has the batch's rows on its first dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

# A model's inputs or a batch's targets: a tensor, a tuple (or list) of tensors, a dict of tensors.
Tree = Any


def leaves(tree: Tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def rows(tree: Tree) -> int:
    """The number of samples in a batch: its tensors' first dimension."""
    tensors = leaves(tree)
    if not tensors:
        raise TypeError(f"a batch of {type(tree).__name__} holds no tensor")
    return len(tensors[0])


def tree_map(function: Callable[[torch.Tensor], Any], tree: Tree) -> Tree:
    """``function`` applied to every tensor of ``tree`` (anything else kept as it is)."""
    return pytree.tree_map(lambda leaf: function(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)


def take(tree: Tree, index: torch.Tensor | slice) -> Tree:
    """The rows ``index`` of every tensor."""
    return tree_map(lambda tensor: tensor[index], tree)


def to_device(tree: Tree, device: torch.device | str, non_blocking: bool = False) -> Tree:
    return tree_map(lambda tensor: tensor.to(device, non_blocking=non_blocking), tree)


def cast_floats(tree: Tree, dtype: torch.dtype) -> Tree:
    """Floating-point tensors in ``dtype``; integer ones (token ids, masks, labels) stay as they are."""
    return tree_map(lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor, tree)


def chunk(tree: Tree, parts: int) -> list[Tree]:
    """``tree`` cut into ``parts`` consecutive runs of rows (``torch.chunk``'s sizes), every tensor cut
    the same way: the micro-steps of ``--grad-accum`` and the microbatches of a pipeline."""
    flat, spec = pytree.tree_flatten(tree)
    pieces = [leaf.chunk(parts) if isinstance(leaf, torch.Tensor) else None for leaf in flat]
    count = min((len(piece) for piece in pieces if piece is not None), default=1)
    return [pytree.tree_unflatten([piece[i] if piece is not None else leaf for piece, leaf in zip(pieces, flat)],
                                  spec) for i in range(count)]


def as_call(inputs: Tree) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments ``inputs`` are passed to a model as."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: nn.Module | Callable[..., Any], inputs: Tree) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple or list, ``model(inputs)`` else."""
    args, kwargs = as_call(inputs)
    return model(*args, **kwargs)


def describe(tree: Tree) -> str:
    """A batch's structure in a few words: ``tensor[32, 64] float32``, ``dict(input_ids: [32, 17] int64, ...)``."""
    def one(tensor: torch.Tensor) -> str:
        return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"

    if isinstance(tree, torch.Tensor):
        return f"tensor{one(tree)}"
    if isinstance(tree, dict):
        return "dict(" + ", ".join(f"{key}: {one(value) if isinstance(value, torch.Tensor) else type(value).__name__}"
                                   for key, value in tree.items()) + ")"
    if isinstance(tree, (tuple, list)):
        return "tuple(" + ", ".join(one(value) if isinstance(value, torch.Tensor) else type(value).__name__
                                    for value in tree) + ")"
    return type(tree).__name__


__all__ = ["Tree", "as_call", "call_model", "cast_floats", "chunk", "describe", "leaves", "rows", "take",
           "to_device", "tree_map"]
