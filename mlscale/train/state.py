"""A model and its update rule as checkpoint state, in the names of the unsplit model.

``torch.distributed.checkpoint.state_dict`` turns a plain module, a DDP or FSDP2 module, a tensor
parallel module or a pipeline stage, and its optimizer, into state keyed by the parameters' fully
qualified names (sharded tensors stay ``DTensor``); every strategy builds its part of a checkpoint
from it, so checkpoints of different strategies and world sizes share one key space.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

from mlscale.train.checkpoint import OPTIMIZER_PREFIX, TrainState
from mlscale.train.strategy import Learner
from mlscale.weights import tie_again, tied_groups

MODEL, OPTIMIZER = "model/", OPTIMIZER_PREFIX


def module_state(model: nn.Module, learner: Learner, *, for_load: bool = False,
                 only: Collection[str] | None = None) -> TrainState:
    """``model`` and ``learner`` as tensors and JSON; ``only``: keep just these parameter names.
    ``for_load``: a template to load into, so the optimizer's state is created first (zeros: a fresh
    optimizer has none, and DCP fills only the tensors it is given)."""
    if for_load:
        _init_optim_state(learner.optimizer)  # what DCP's own set_state_dict does before loading
    if not for_load and not learner.optimizer.state:
        # A stateless optimizer (SGD without momentum) has nothing to save but its hyperparameters; DCP's
        # get_state_dict would first give every parameter a zero gradient and step on it (_init_optim_state):
        # a transient copy of the weights, too much for a model sharded to fit (--optimizer-in-backward).
        model_state = get_model_state_dict(model)
        optimizer_state = {"state": {}, "param_groups": learner.optimizer.param_groups}
    else:
        model_state, optimizer_state = get_state_dict(model, learner.optimizer)
    tensors = {MODEL + name: value for name, value in model_state.items() if only is None or name in only}
    extra: dict[str, dict[str, Any]] = {}
    for name, values in optimizer_state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER}{name}/{key}"] = value
            else:
                extra.setdefault(name, {})[key] = value
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in optimizer_state["param_groups"]]
    meta = {"optimizer_groups": groups, "optimizer_extra": extra, "scheduler": learner.scheduler.state_dict(),
            "scaler": learner.scaler.state_dict()}
    return TrainState(tensors, meta)


def load_module_state(model: nn.Module, learner: Learner, state: TrainState, *, strict: bool = True) -> None:
    """Put ``state`` (filled from a checkpoint) into ``model`` and ``learner``."""
    model_state = {name[len(MODEL):]: value for name, value in state.tensors.items() if name.startswith(MODEL)}
    optimizer: dict[str, dict[str, Any]] = {}
    for name, value in state.tensors.items():
        if name.startswith(OPTIMIZER):
            fqn, key = name[len(OPTIMIZER):].rsplit("/", 1)
            optimizer.setdefault(fqn, {})[key] = value
    for fqn, values in state.meta.get("optimizer_extra", {}).items():
        if fqn in optimizer:
            optimizer[fqn].update(values)
    # The parameter lists are this rank's (a layout may differ from the writer's); the values are saved ones.
    groups = get_optimizer_state_dict(model, learner.optimizer)["param_groups"]
    for group, saved in zip(groups, state.meta["optimizer_groups"]):
        group.update(saved)
    set_state_dict(model, learner.optimizer, model_state_dict=model_state,
                   optim_state_dict={"state": optimizer, "param_groups": groups},
                   options=StateDictOptions(strict=strict))
    learner.scheduler.load_state_dict(state.meta["scheduler"])
    if state.meta["scaler"] and learner.scaler.is_enabled():  # an fp32/bf16 checkpoint has no scaler state
        learner.scaler.load_state_dict(state.meta["scaler"])


def assemble(build: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain model holding ``state`` (a full state dict on the CPU), built without allocating its own
    weights first (on the meta device, then the tensors assigned), so assembling a split model needs
    no second copy. A model with buffers outside its state dict is built normally instead. Weights the
    model ties (a head sharing the embedding) are one tensor again, as built."""
    with torch.device("meta"):
        model = build()
    ties = tied_groups(model)
    model.load_state_dict(state, assign=True)
    tie_again(model, ties)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model = build().to("cpu")
        model.load_state_dict(state)
    return model



def release(learner: Learner) -> None:
    """Free the gradients and the optimizer state once training has ended (the last checkpoint is
    written), making room to gather the trained model."""
    learner.optimizer.zero_grad(set_to_none=True)
    learner.optimizer.state.clear()


class OneModuleState:
    """For a strategy that trains one module (``self.module``: plain, DDP, FSDP2, tensor parallel or a
    pipeline stage) with one update rule (``self.learner``): its checkpoint state and learning rate."""

    module: nn.Module
    learner: Learner

    def lr(self) -> float:
        return self.learner.scheduler.get_last_lr()[0]

    def train_state(self) -> TrainState:
        return module_state(self.module, self.learner)

    def state_template(self) -> TrainState:
        return module_state(self.module, self.learner, for_load=True)

    def load_train_state(self, state: TrainState) -> None:
        load_module_state(self.module, self.learner, state)
