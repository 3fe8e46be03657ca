"""A model's weights as one file: the single writer and reader of every safetensors file of weights
(the run's final weights, the registry's copy of them, what serving, export and the benchmarks load).

The file holds every name of the model's state dict, so any reader loads it with
``model.load_state_dict(safetensors.torch.load_file(path), strict=True)`` and needs nothing of ours.
safetensors refuses two names that share one storage, and most language models tie their output head
to the token embedding (``lm_head.weight`` *is* ``transformer.wte.weight``): such a tie is written as
one tensor per name (the copies equal, so the file costs one extra copy of each tied tensor), and the
tie itself is recorded in the metadata (``mlscale.tied``: a JSON list of the groups of names that are
one tensor). Loading copies into the model's own tensors, so a model that ties them (as the freshly
built one does) keeps its tie: one storage, trained as one. No pickle anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mlscale.common.io import atomic_write
from mlscale.errors import MlscaleError

TIED_KEY = "mlscale.tied"  # metadata: JSON list of groups of state-dict names that are one tensor


class WeightsError(MlscaleError):
    """A weights file that does not fit the model it is loaded into."""


def _tie_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What makes two tensors one: the same bytes of the same storage, seen the same way; on the meta
    device (no storage), the same tensor object. None for an empty tensor (nothing to share)."""
    if tensor.is_meta:
        return ("meta", id(tensor))
    if tensor.untyped_storage().nbytes() == 0:
        return None
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
            tuple(tensor.shape), tensor.stride())


def _groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    by_tensor: dict[tuple[object, ...], list[str]] = {}
    for name, tensor in state.items():
        key = _tie_key(tensor)
        if key is not None:
            by_tensor.setdefault(key, []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The groups of state-dict names that are one tensor in ``model`` (``[["transformer.wte.weight",
    "lm_head.weight"]]`` for GPT-2), each in state-dict order; empty for a model without ties. Works on
    a model built on the meta device too (a tie there is one Parameter under two names)."""
    return _groups(model.state_dict(keep_vars=True))


def tie_again(model: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    """Make each group of names one tensor again (the first name's) where their values are equal, as
    after ``load_state_dict(assign=True)``, which gives every name a tensor of its own; returns the
    groups tied. A group whose values differ is left apart: tying it would drop trained values."""
    tied, state = [], model.state_dict(keep_vars=True)  # the Parameters and buffers themselves
    for first, *others in groups:
        keep = state[first]
        if not keep.is_meta and all(torch.equal(state[name], keep) for name in others):
            for name in others:
                owner, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(owner), attribute, keep)
            tied.append([first, *others])
    return tied


def save_weights(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write every state-dict name of ``model`` to ``path`` (atomically: a reader sees the old file or
    the new one), ties recorded under ``mlscale.tied``; ``metadata``: more string pairs to keep."""
    from safetensors.torch import save_file

    state = model.state_dict()
    groups = _groups(state)
    tensors: dict[str, torch.Tensor] = {}
    written: set[int] = set()  # storages already in the file: a second view of one is copied
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in written and tensor.numel() else tensor
        written.add(storage)
    meta = {**(metadata or {}), "format": "pt", TIED_KEY: json.dumps(groups)}
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_weights(source: str | Path | bytes) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, or of its bytes (the registry hands over the bytes it verified)."""
    from safetensors.torch import load, load_file

    try:
        return load(source) if isinstance(source, bytes) else load_file(str(source))
    except Exception as exc:  # safetensors' own errors: a truncated or foreign file
        raise WeightsError(f"not a safetensors weights file: {str(exc).splitlines()[0]}") from None


def load_weights(model: nn.Module, source: str | Path | bytes) -> nn.Module:
    """Load a weights file into ``model`` with ``strict=True`` and return it. Values are copied into the
    model's own tensors, so its ties stay ties (one storage); a file whose copies of one tied tensor
    differ is refused (loading would keep one of them silently)."""
    state = read_weights(source)
    for group in tied_groups(model):
        present = [name for name in group if name in state]
        for name in present[1:]:
            if not torch.equal(state[name], state[present[0]]):
                raise WeightsError(f"the model ties {name} to {present[0]} (one tensor) but the weights file "
                                   "holds different values for them")
    expected = model.state_dict().keys()
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise WeightsError(f"the weights do not fit the model: {len(missing)} name(s) missing"
                           + (f" (first: {missing[0]})" if missing else "")
                           + f", {len(unexpected)} unexpected" + (f" (first: {unexpected[0]})" if unexpected else ""))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # a shape that differs: torch lists every one; the first says enough
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise WeightsError(f"the weights do not fit the model: {lines[1] if len(lines) > 1 else lines[0]}") from None
    return model
