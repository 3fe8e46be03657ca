"""How the requests of one batch become the model's one input, and its output each request's answer.

A request's inputs are one array (a model of one input, ``input``) or a dict of arrays by input name
(a model of several: ``mlscale.registry.inputs``), every array with the request's rows first. Three
ways to put requests together, chosen from the signature (``batching_for``):

- ``concat``: every dimension past the batch is fixed; the arrays are concatenated (a model of one
  input is batched exactly so, as it always was).
- ``pad``: the inputs have a sequence axis (dimension 1 open, -1) and the model takes an
  ``attention_mask``: each input is padded with 0 after its end to the batch's longest request, the
  mask too, so the padded positions are masked out and each request gets the answer it gets alone
  (checked end to end with a BERT classifier; the answers agree to float rounding, rtol 1e-4). An
  output with a sequence axis is cut back to each request's own length. A batch only takes requests
  whose lengths are within ``spread`` (1.5x) of each other: padding a wide mix of lengths to the
  longest costs more compute than batching saves (attention grows with the square of the length); a
  request left out is first in line for the next batch.
- ``group``: open dimensions but no mask to say what is padding: only requests whose inputs have the
  same shapes share a batch (the others wait for the next), so nothing is padded and no answer changes.

``bench serve-lengths`` measures padding against grouping and against no batching
(``bench/results/serve-lengths/``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mlscale.serve.runtime import Inputs, TensorSpec

Mode = Literal["concat", "pad", "group"]
MASK = "attention_mask"  # the input whose 0s say which positions are padding (Hugging Face's name)


def rows_of(inputs: Inputs) -> int:
    """The rows of a request or a batch: its arrays' first dimension."""
    return len(next(iter(inputs.values())) if isinstance(inputs, dict) else inputs)


@dataclass(frozen=True)
class Batching:
    mode: Mode = "concat"
    padded: tuple[str, ...] = ()  # (pad) the inputs padded along dimension 1
    output_padded: bool = False  # (pad) the output has the sequence on dimension 1: cut back per request
    spread: float | None = 1.5  # (pad) a batch's longest request is at most this many times its shortest

    def key(self, inputs: Inputs) -> Hashable:
        """What decides which requests may share a batch with this one (``admits``): its shapes past the
        batch (``group``), its sequence length (``pad``), nothing (``concat``)."""
        if self.mode == "pad":
            return self.length(inputs)
        if self.mode != "group":
            return None
        if isinstance(inputs, dict):
            return tuple(array.shape[1:] for array in inputs.values())
        return inputs.shape[1:]

    def admits(self, keys: Sequence[Hashable], key: Hashable) -> bool:
        """May a request of ``key`` join a batch of requests of ``keys``? ``group``: the same shapes;
        ``pad``: the batch's longest at most ``spread`` times its shortest. Measured (``bench
        serve-lengths``, lengths 8-128): padding to the longest of any mix was slower than no batching;
        1.25x-2x were faster than both, 1.5x within ~15% of the best spread on narrow and wide mixes."""
        if self.mode == "group":
            return key == keys[0]
        if self.mode != "pad" or self.spread is None:
            return True
        lengths = [*keys, key]
        return max(lengths) <= self.spread * min(lengths)  # type: ignore[type-var, operator]

    def join(self, parts: Sequence[Inputs]) -> Inputs:
        """The requests' inputs as one batch, in their order."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if not isinstance(first, dict):
            return np.concatenate(parts)
        longest = max(self.length(part) for part in parts) if self.padded else 0
        return {name: _padded([part[name] for part in parts], longest) if name in self.padded
                else np.concatenate([part[name] for part in parts]) for name in first}

    def length(self, inputs: Inputs) -> int:
        """(pad) The request's sequence length: dimension 1 of its padded inputs (one length for all,
        which the protocol checks)."""
        assert isinstance(inputs, dict)
        return inputs[self.padded[0]].shape[1]

    def answer(self, output: np.ndarray, start: int, inputs: Inputs) -> np.ndarray:
        """One request's answer: its rows of the batch's output, cut back to its own length when the
        output carries the (padded) sequence."""
        rows = output[start:start + rows_of(inputs)]
        return rows[:, :self.length(inputs)] if self.output_padded else rows


def _padded(arrays: list[np.ndarray], length: int) -> np.ndarray:
    """The arrays stacked on their rows, each padded with 0 along dimension 1 to ``length``."""
    batch = np.zeros((sum(len(a) for a in arrays), length, *arrays[0].shape[2:]), dtype=arrays[0].dtype)
    start = 0
    for array in arrays:
        batch[start:start + len(array), :array.shape[1]] = array
        start += len(array)
    return batch


def batching_for(inputs: Sequence[TensorSpec], output: TensorSpec) -> Batching:
    """How a model with this signature is batched: ``concat`` when only the batch is open, ``pad`` when
    the open dimensions are a sequence on dimension 1 and the model takes an ``attention_mask``, else
    ``group``."""
    open_dims = {spec.name: [dim for dim, size in enumerate(spec.shape) if size == -1 and dim > 0] for spec in inputs}
    if not any(open_dims.values()):
        return Batching("concat")
    names = {spec.name for spec in inputs}
    if MASK in names and all(dims in ([], [1]) for dims in open_dims.values()) and open_dims[MASK] == [1]:
        padded = tuple(name for name, dims in open_dims.items() if dims)
        return Batching("pad", padded, output_padded=len(output.shape) > 1 and output.shape[1] == -1)
    return Batching("group")


__all__ = ["MASK", "Batching", "Inputs", "batching_for", "rows_of"]
