"""The step shared by strategies where every rank runs the whole forward and backward of its model
(a full replica under ddp, a sharded one under fsdp, a tensor-parallel slice under tp): the strategy
only says how the plain model is wrapped, and the wrapper does the communication inside the step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mlscale.data.batches import call_model, chunk
from mlscale.train.dist import all_gather_floats
from mlscale.train.materialize import materialize
from mlscale.train.memory import SavedActivations, state_memory
from mlscale.train.parallelize import TPPlan, apply_activation_checkpointing
from mlscale.train.state import OneModuleState, assemble, release
from mlscale.train.strategy import Batch, Learner, Setup, StepResult, StepRow, Strategy
from mlscale.train.timing import StepTimes, now


class ReplicaStrategy(OneModuleState, Strategy):
    """Subclasses implement ``wrap``; with one process the plain model trains unwrapped."""

    replicated: ClassVar[bool] = False  # every rank holds the whole model (ddp), else it is split
    plan_ignores = ("microbatches", "schedule", "stages")  # the pipeline's: a replica runs the whole step

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def announce(self, plan: TPPlan) -> TPPlan:
        if self.env.is_main:
            print(f"mlscale: {plan.describe()}", file=sys.stderr, flush=True)
        return plan

    def setup(self, setup: Setup) -> None:
        self.plain, self.build_plain = setup.model, setup.build_model
        self.declared_tp_plan = setup.tp_plan
        self.tp_plan: TPPlan | None = None
        model_options = self.config.model
        self.checkpointed_blocks = apply_activation_checkpointing(
            setup.model, model_options.activation_checkpointing, model_options.ac_every)
        if self.config.ddp.compile:  # in place: the module, its parameters and their names stay the same
            setup.model.compile()
        self.module: nn.Module = self.wrap(setup.model) if self.env.distributed else setup.model
        if any(param.is_meta for param in self.module.parameters()):  # built on the meta device: fill it now
            full = setup.full_weights if self.env.is_main and setup.weight_init == "full" else None
            materialize(self.module, self.env.device, setup.weight_init, full)
        self.learner: Learner = setup.make_learner(self.module.parameters())
        self.loss_fn, self.total_steps = setup.loss_fn, setup.total_steps
        self.steps_done, self.global_batch = setup.start_step, setup.global_batch
        self.start_step = setup.start_step
        self.activations_mb: float | None = None
        self.first_step_ms: float | None = None

    def step(self, batch: Batch | None) -> StepResult:
        assert batch is not None, f"every {self.name} rank reads data"
        micro = self.plan.grad_accum  # --grad-accum K: K micro-steps of --batch-size, synchronised once
        inputs, targets = chunk(batch.inputs, micro), chunk(batch.targets, micro)  # already on the device
        losses = []
        for i in range(micro):
            # The first step also measures what autograd keeps for backward (the activations).
            saved = SavedActivations(self.module.parameters()) if self.activations_mb is None else None
            with self.synchronising(i == micro - 1):
                with self.learner.autocast(), saved or contextlib.nullcontext():
                    loss = self.loss_fn(call_model(self.module, inputs[i]), targets[i])
                self.learner.backward(loss / micro if micro > 1 else loss, accumulate=i > 0)
            if saved is not None:
                self.activations_mb = saved.mb
            losses.append(loss.detach())
        loss = losses[0] if micro == 1 else torch.stack(losses).mean()
        backward_end = now()
        if self.env.device.type == "cuda":  # what the backward queued is done before the update is timed
            torch.cuda.synchronize(self.env.device)
        if not self.reduce_gradients():
            return StepResult(step=self.steps_done, done=False, applied=False)
        update_start = now()
        self.learner.apply()
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        end = now()
        step_ms, optimizer_ms = (end - batch.started) * 1e3, (end - update_start) * 1e3
        comm_ms, exposed_ms = self.comm.take(backward_end)
        row = StepRow(self.env.rank, loss.detach(), StepTimes(
            step_ms=step_ms, compute_ms=step_ms - batch.data_ms - exposed_ms - optimizer_ms, comm_ms=comm_ms,
            comm_exposed_ms=exposed_ms, data_wait_ms=batch.data_ms, optimizer_ms=optimizer_ms))
        if self.first_step_ms is None:
            self.first_step_ms = step_ms  # with --compile: includes compiling the model
        self.steps_done += 1
        return StepResult(step=self.steps_done, done=self.steps_done >= self.total_steps, samples=self.global_batch,
                          rows=[row], positions=dict.fromkeys(range(self.shards), batch.position))

    def reduce_gradients(self) -> bool:
        """After the backward pass: anything left to do to the gradients before the update (the wrapper
        has all-reduced them already); False discards the step (no update), for its batch to be redone."""
        return True

    def synchronising(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-step's forward and backward: whether its gradients are synchronised (the last
        of ``--grad-accum`` micro-steps) or only accumulated locally."""
        return contextlib.nullcontext()

    def gather_floats(self, rows: list[list[float]]) -> list[list[float]]:
        (own,) = rows
        return all_gather_floats(self.env, own)

    def evaluator(self) -> nn.Module | None:
        if self.replicated or not self.env.distributed:  # a replica: rank 0 alone, on the plain model
            return self.plain if self.env.is_main else None
        return self.module  # sharded: every rank takes part in the forward

    def memory(self) -> dict[str, float]:
        return {**state_memory(self.module.parameters(), [self.learner.optimizer]),
                "activations_mb": self.activations_mb or 0.0}

    def full_model(self) -> nn.Module | None:
        if self.replicated or not self.env.distributed:
            return self.plain if self.env.is_main else None
        # Sharded parameters: gathered whole onto rank 0's CPU (a collective), into a plain model.
        release(self.learner)  # called once, after the last checkpoint
        with _quiet_redistribution():
            full: dict[str, Any] = get_model_state_dict(
                self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return assemble(self.build_plain, full) if self.env.is_main else None


@contextlib.contextmanager
def _quiet_redistribution():
    """DTensor warns on every rank that gathering a fsdp x tp parameter (sharded on both mesh dimensions)
    takes two all-gathers instead of one: true, and of no consequence for the one gather of the weights."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
