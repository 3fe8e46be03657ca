"""Building a model without its weights, then giving each rank only the part it holds.

A model larger than one process cannot be built whole on every rank before it is sharded. So under fsdp and
tp the model is built with its parameters on the meta device (shapes only, no memory: the parameters are
moved there one by one as the model's ``__init__`` registers them, as Hugging Face Accelerate's
``init_empty_weights`` does; buffers stay real, since a non-persistent buffer such as a rotary embedding's
frequencies is in no state dict to be filled from later), split by the strategy, and only then materialised:

- ``full``: rank 0 builds the whole model as one process would (same seed, same weights) and streams it to
  the shards tensor by tensor (``set_model_state_dict(..., broadcast_from_rank0=True)``). Every strategy and
  world size then starts from the same weights, which is what makes runs comparable (and is tested equal
  to one process in float64). Rank 0 holds the whole model once, the other ranks never do.
- ``sharded``: each rank fills its own shards by the model's own initialisation: its ``init_weights()``
  (a Hugging Face model's, or a model written like torchtitan's), else every module's
  ``reset_parameters()``. Nothing whole exists anywhere, so a model larger than any one process starts;
  its initial weights are the model's distribution, not bit-equal to one process's draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mlscale.weights import tied_groups

MB = 2**20


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While open, every parameter a module registers is moved to the meta device (its buffers stay)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind, requires_grad = type(param), param.requires_grad
            module._parameters[name] = kind(param.to("meta"), requires_grad=requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with parameters_on_meta():
        return build()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s distinct parameters (a tie counted once); works on the meta device."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[id(param)] = param.numel() * param.element_size()
    return sum(seen.values())


def materialize(model: nn.Module, device: torch.device, how: str, full: Callable[[], dict[str, Any]] | None) -> None:
    """Allocate the (split) parameters of ``model`` on ``device`` and fill them: from ``full()`` (rank 0's
    whole state dict, ``None`` elsewhere: ``how == "full"``) or by the model's own initialisation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = {name: buffer.to(device) for name, buffer in model.named_buffers() if not buffer.is_meta}
    ties = [[name for name in group if name not in buffers] for group in tied_groups(model)]
    model.to_empty(device=device)  # a new Parameter per holder: a tie becomes two tensors, made one again below
    for first, *others in (group for group in ties if len(group) > 1):
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    for name, value in buffers.items():  # to_empty left them uninitialised: their values come back
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value
    if how == "sharded":
        initialise(model)
        return
    state = full() if full is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def initialise(model: nn.Module) -> None:
    """The model's own initialisation, run on whatever part of its parameters this rank holds."""
    with torch.no_grad():
        init_weights = getattr(model, "init_weights", None)
        if callable(init_weights):
            for module in model.modules():  # Hugging Face skips modules it marked initialised when built
                if getattr(module, "_is_hf_initialized", False):
                    module._is_hf_initialized = False
            init_weights()
            return
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
