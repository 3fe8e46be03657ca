"""Data parallelism with PyTorch DistributedDataParallel.

Every worker holds a full replica; DDP averages gradients with bucketed all-reduce that overlaps the
backward pass. A timing comm hook wraps DDP's own all-reduce hook so communication is measured, not
estimated. With one worker nothing is wrapped and no process group exists.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from mlscale.train.checkpoint import TrainState
from mlscale.train.dist import all_gather_floats
from mlscale.train.state import load_module_state, module_state
from mlscale.train.strategy import Batch, Learner, Setup, StepResult, StepRow, Strategy
from mlscale.train.timing import CommTimer, now


# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.
def _timed_allreduce(timer: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    start = timer.launched()
    future = default_hooks.allreduce_hook(None, bucket)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        timer.finished(start)
        return fut.value()

    return future.then(done)


class DDPStrategy(Strategy):
    name = "ddp"

    def setup(self, setup: Setup) -> None:
        self.plain = setup.model
        self.module: nn.Module = setup.model
        if self.env.distributed:
            device_ids = [self.env.device] if self.env.device.type == "cuda" else None
            self.module = DistributedDataParallel(setup.model, device_ids=device_ids)
            self.module.register_comm_hook(self.comm, _timed_allreduce)
        self.learner: Learner = setup.make_learner(self.module.parameters())
        self.loss_fn, self.total_steps = setup.loss_fn, setup.total_steps
        self.steps_done, self.global_batch = setup.start_step, setup.global_batch

    def step(self, batch: Batch | None) -> StepResult:
        assert batch is not None, "every ddp rank reads data"
        device = self.env.device
        with self.learner.autocast():  # the trainer has put the batch on the device
            loss = self.loss_fn(self.module(batch.inputs), batch.targets)
        self.learner.backward(loss)
        backward_end = now()
        self.learner.apply()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_ms = (now() - batch.started) * 1e3
        comm_ms, exposed_ms = self.comm.take(backward_end)
        row = StepRow(self.env.rank, loss.detach(), step_ms, step_ms - batch.data_ms - exposed_ms, comm_ms,
                      exposed_ms, batch.data_ms)
        self.steps_done += 1
        return StepResult(step=self.steps_done, done=self.steps_done >= self.total_steps, samples=self.global_batch,
                          rows=[row], positions=dict.fromkeys(range(self.env.world_size), batch.position))

    def lr(self) -> float:
        return self.learner.scheduler.get_last_lr()[0]

    def share(self, rows: list[list[float]]) -> list[list[float]]:
        (own,) = rows
        return all_gather_floats(self.env, own)

    def train_state(self) -> TrainState:
        return module_state(self.module, self.learner)

    def state_template(self) -> TrainState:
        return module_state(self.module, self.learner, for_load=True)

    def load_train_state(self, state: TrainState) -> None:
        load_module_state(self.module, self.learner, state)

    def full_model(self) -> nn.Module | None:
        return self.plain if self.env.is_main else None
