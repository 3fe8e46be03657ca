"""Data parallelism with PyTorch DistributedDataParallel.

Every worker holds a full replica; DDP averages gradients with bucketed all-reduce that overlaps the
backward pass. A timing comm hook wraps DDP's own all-reduce hook so communication is measured, not
estimated. With one worker nothing is wrapped and no process group exists.
"""

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from mlscale.train.strategies.replica import ReplicaStrategy
from mlscale.train.timing import CommTimer


# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.
def _timed_allreduce(timer: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    start = timer.launched()
    future = default_hooks.allreduce_hook(None, bucket)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        timer.finished(start)
        return fut.value()

    return future.then(done)


class DDPStrategy(ReplicaStrategy):
    name = "ddp"
    replicated = True

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        module = DistributedDataParallel(model, device_ids=device_ids)
        module.register_comm_hook(self.comm, _timed_allreduce)
        return module

    def report(self) -> dict[str, Any]:
        steps = self.steps_done - self.start_step
        return {"communication": {"allreduce_buckets": self.comm.calls,  # counted by the comm hook
                                  "allreduce_buckets_per_step": self.comm.calls / steps if steps else 0.0,
                                  "grad_accum": self.config.grad_accum}}

    def synchronising(self, sync: bool) -> contextlib.AbstractContextManager[object]:
        if sync or not isinstance(self.module, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.module.no_sync()  # DDP's own: gradients stay local, no all-reduce
