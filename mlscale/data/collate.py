"""Collate functions: a list of ``(inputs, target)`` items into one batch ``(inputs, targets)``.

``stack`` is the default (every item's tensors the same shape, stacked on a new first dimension, as
torch's ``default_collate`` does). ``PadCollate`` is for samples of different lengths (text): each
tensor is padded along its first dimension to the batch's longest (or to a fixed ``length``, which a
pipeline's stages need: they exchange tensors of the shapes they were traced with), on the side and
with the value asked, and makes an attention mask when asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate, get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from mlscale.data.batch_buffers import in_ring, shared_copy, shared_empty
from mlscale.data.batches import Tree


def _as_tuple(tree: Tree) -> Tree:
    """``default_collate`` returns a list for a tuple of tensors: a tuple again, as the items had it."""
    return tuple(tree) if isinstance(tree, list) else tree


def split_items(items: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The items' inputs and targets, apart; an item that is not an ``(inputs, target)`` pair is refused."""
    inputs, targets = [], []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"an item must be an (inputs, target) pair, not {_kind(item)}")
        inputs.append(item[0])
        targets.append(item[1])
    return inputs, targets


def _kind(item: Any) -> str:
    if isinstance(item, (tuple, list)):
        return f"a {type(item).__name__} of {len(item)}"
    return f"a {type(item).__name__}"


def _stack_keeping_layout(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """Tensors stacked as ``default_collate`` does, but a batch of images laid out channels-last (an image
    ``3 x H x W`` whose memory is ``H x W x 3``, as a decoder writes it) is stacked channels-last: one copy a
    sample instead of a transposing copy of the whole batch (7.5 ms of 82 ms a batch of 64 crops of 224 px,
    measured in a data worker). Convolutions take either layout, and ``.to(device)`` keeps it. In a data
    worker the batch goes straight into shared memory, as ``default_collate`` does, into a segment the
    worker reuses when it can (``batch_buffers``)."""
    first = batch[0]
    alike = all(t.shape == first.shape and t.dtype == first.dtype for t in batch)
    if not (alike and _channels_last_image(first) and all(t.stride() == first.stride() for t in batch)):
        if alike and in_ring() and first.layout == torch.strided and not first.is_nested and first.device.type == "cpu":
            size = (len(batch), *first.shape)
            return torch.stack(list(batch), out=shared_empty(size, _contiguous(size), first.dtype))
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    channels, height, width = first.shape
    size = (len(batch), channels, height, width)
    if get_worker_info() is not None:
        out = shared_empty(size, (height * width * channels, 1, width * channels, channels), first.dtype)
    else:
        out = torch.empty(size, dtype=first.dtype, device=first.device, memory_format=torch.channels_last)
    for row, tensor in zip(out, batch, strict=True):
        row.copy_(tensor)
    return out


def _channels_last_image(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 3 and not tensor.is_contiguous() and tensor.permute(1, 2, 0).is_contiguous()


def _contiguous(size: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _ints(batch: Sequence[int], *, collate_fn_map: Any = None) -> torch.Tensor:
    """Numbers as ``default_collate`` makes them (int64, float64), in the worker's ring when it has one
    (else torch moves them into a fresh segment of their own when it sends the batch)."""
    return shared_copy(torch.tensor(batch))


def _floats(batch: Sequence[float], *, collate_fn_map: Any = None) -> torch.Tensor:
    return shared_copy(torch.tensor(batch, dtype=torch.float64))


COLLATE_MAP = {**default_collate_fn_map, torch.Tensor: _stack_keeping_layout, int: _ints, float: _floats}


def stack(items: Sequence[Any]) -> tuple[Tree, Tree]:
    """Every item's tensors stacked on a new first dimension (dicts by key, tuples by position), as torch's
    ``default_collate`` does; images laid out channels-last stay so (``_stack_keeping_layout``)."""
    inputs, targets = split_items(items)
    return (_as_tuple(collate(inputs, collate_fn_map=COLLATE_MAP)),
            _as_tuple(collate(targets, collate_fn_map=COLLATE_MAP)))


@dataclass(frozen=True)
class PadCollate:
    """Pad variable-length samples to one length per batch.

    Every tensor of an item's inputs (and of its target, when ``target_pad`` is given) is padded along its
    first dimension to the longest in the batch (or to ``length``: samples longer than it are refused,
    not cut), before (``side="left"``) or after (``"right"``) the sample, with ``pad_value`` (one value,
    or one per input name). With ``mask`` set and dict inputs, a tensor of that name is added (unless the
    items carry it): 1 where a sample has data, 0 where it was padded, from the first input's lengths.

    ``PadCollate(mask="attention_mask")`` suits a Hugging Face encoder; ``target_pad=-100`` pads
    token-level labels with the value ``cross_entropy`` ignores."""

    pad_value: float | Mapping[str, float] = 0
    side: Literal["right", "left"] = "right"
    mask: str | None = None
    length: int | None = None
    target_pad: float | None = None

    def __post_init__(self) -> None:
        if self.side not in ("right", "left"):
            raise ValueError(f"PadCollate side must be 'right' or 'left', not {self.side!r}")
        if self.length is not None and self.length < 1:
            raise ValueError(f"PadCollate length must be at least 1, not {self.length}")

    def __call__(self, items: Sequence[Any]) -> tuple[Tree, Tree]:
        inputs, targets = split_items(items)
        first = inputs[0]
        if isinstance(first, Mapping):
            batch: Tree = {key: self._pad([item[key] for item in inputs], self._value(key)) for key in first}
            if self.mask is not None and self.mask not in batch:
                lengths = [len(torch.as_tensor(item[next(iter(first))])) for item in inputs]
                batch[self.mask] = self._mask(lengths)
        elif self.mask is not None:
            raise TypeError(f"PadCollate(mask={self.mask!r}) makes a named input: the items' inputs must be a dict")
        elif isinstance(first, (tuple, list)):
            batch = tuple(self._pad([item[i] for item in inputs], self._value(i)) for i in range(len(first)))
        else:
            batch = self._pad(inputs, self._value(None))
        if self.target_pad is None:
            return batch, _as_tuple(default_collate(targets))
        return batch, self._pad_tree(targets, self.target_pad)

    def _value(self, key: str | int | None) -> float:
        if isinstance(self.pad_value, Mapping):
            return float(self.pad_value.get(key, 0)) if isinstance(key, str) else 0.0
        return float(self.pad_value)

    def _pad_tree(self, items: list[Any], value: float) -> Tree:
        if isinstance(items[0], Mapping):
            return {key: self._pad([item[key] for item in items], value) for key in items[0]}
        return self._pad(items, value)

    def _pad(self, samples: list[Any], value: float) -> torch.Tensor:
        tensors = [torch.as_tensor(sample) for sample in samples]
        if tensors[0].dim() == 0:  # one number per sample: nothing to pad
            return torch.stack(tensors)
        longest = max(len(tensor) for tensor in tensors)
        target = self.length if self.length is not None else longest
        if longest > target:
            raise ValueError(f"a sample of length {longest} is longer than PadCollate(length={target})")
        padded = pad_sequence(tensors, batch_first=True, padding_value=value, padding_side=self.side)
        if padded.shape[1] < target:
            extra = torch.full((len(tensors), target - padded.shape[1], *padded.shape[2:]), value, dtype=padded.dtype)
            padded = torch.cat([padded, extra] if self.side == "right" else [extra, padded], dim=1)
        return padded

    def _mask(self, lengths: list[int]) -> torch.Tensor:
        width = self.length if self.length is not None else max(lengths)
        positions = torch.arange(width).expand(len(lengths), width)
        sizes = torch.tensor(lengths).unsqueeze(1)
        present = positions < sizes if self.side == "right" else positions >= width - sizes
        return present.long()


__all__ = ["PadCollate", "split_items", "stack"]
