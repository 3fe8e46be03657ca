"""Data parallelism with PyTorch DistributedDataParallel.

Every worker holds a full replica; DDP averages gradients with bucketed all-reduce (``--bucket-mb``)
that overlaps the backward pass. A timing comm hook wraps DDP's own hook (plain all-reduce, or
``--compress fp16|bf16|powersgd``) so communication time and the bytes sent are measured, not
estimated. With one worker nothing is wrapped and no process group exists.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from mlscale.config import DDPOptions, TrainConfig
from mlscale.errors import UsageError
from mlscale.train.strategies.replica import ReplicaStrategy
from mlscale.train.timing import CommTimer


@dataclass
class CommState:
    """What the timing hook carries: the timer, the wrapped hook and its own state, the bytes sent."""

    timer: CommTimer
    hook: Callable[..., Any]
    inner: Any  # the wrapped hook's state: None, or PowerSGD's
    compress: str
    bytes_sent: int = 0

    def bucket_bytes(self, bucket: dist.GradBucket, powersgd_elements: int) -> int:
        """Bytes this rank contributes to the all-reduces of ``bucket``, from the tensors sent.
        ``powersgd_elements``: what PowerSGD counted for this bucket (its factors P and Q of the matrices
        it compresses, plus the tensors it sends as they are); 0 in its uncompressed first steps."""
        buffer = bucket.buffer()
        if self.compress in ("fp16", "bf16"):
            return buffer.numel() * 2  # the bucket is cast to 16 bits before the all-reduce
        if powersgd_elements:
            return powersgd_elements * buffer.element_size()
        return buffer.numel() * buffer.element_size()


# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.
def _timed_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    start = state.timer.launched()
    counted = state.inner.total_numel_after_compression if state.compress == "powersgd" else 0
    future = state.hook(state.inner, bucket)
    after = state.inner.total_numel_after_compression if state.compress == "powersgd" else 0
    state.bytes_sent += state.bucket_bytes(bucket, after - counted)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.timer.finished(start)
        return fut.value()

    return future.then(done)


def comm_hook(compress: str, process_group: Any) -> tuple[Callable[..., Any], Any]:
    """DDP's own hook for ``--compress`` and its state: plain all-reduce, fp16 / bf16 compression
    (cast, all-reduce, cast back), or PowerSGD (rank-2 approximation with error feedback, after 10
    uncompressed steps)."""
    if compress == "fp16":
        return default_hooks.fp16_compress_hook, process_group
    if compress == "bf16":
        return default_hooks.bf16_compress_hook, process_group
    if compress == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=process_group, matrix_approximation_rank=2,
                                            start_powerSGD_iter=10, use_error_feedback=True, warm_start=True)
        return powerSGD_hook.powerSGD_hook, state
    return default_hooks.allreduce_hook, process_group


class DDPStrategy(ReplicaStrategy):
    name = "ddp"
    options = DDPOptions
    replicated = True

    @classmethod
    def check(cls, config: TrainConfig, world: int) -> None:
        if config.ddp.compress == "powersgd" and config.compute.precision == "fp16":
            raise UsageError("bad value compress='powersgd': with --precision fp16 the all-reduced gradients are "
                             "loss-scaled, and one overflow would poison PowerSGD's error feedback for good; use "
                             "--precision bf16, or fp16 compression")

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        # Gradients as views of the all-reduce buckets: with a comm hook DDP copies each gradient into its
        # bucket and the hook averages it there (without one, DDP divides while copying); as views, the
        # averaged bucket is the gradient, with no copy back. The same values, one pass less per step.
        module = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.config.ddp.bucket_mb,
                                         gradient_as_bucket_view=True)
        hook, inner = comm_hook(self.config.ddp.compress, None)
        self.comm_state = CommState(self.comm, hook, inner, self.config.ddp.compress)
        module.register_comm_hook(self.comm_state, _timed_hook)
        return module

    def report(self) -> dict[str, Any]:
        steps = self.steps_done - self.start_step
        sent = getattr(self, "comm_state", None)
        sent_bytes = sent.bytes_sent if sent is not None else 0
        return {"communication": {"allreduce_buckets": self.comm.calls,  # counted by the comm hook
                                  "allreduce_buckets_per_step": self.comm.calls / steps if steps else 0.0,
                                  "bytes_sent": sent_bytes, "bytes_sent_per_step": sent_bytes / steps if steps else 0.0,
                                  "compress": self.config.ddp.compress, "bucket_mb": self.config.ddp.bucket_mb,
                                  "grad_accum": self.plan.grad_accum},
                "compile": {"enabled": self.config.ddp.compile, "first_step_ms": self.first_step_ms}}

    def synchronising(self, sync: bool) -> contextlib.AbstractContextManager[object]:
        if sync or not isinstance(self.module, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.module.no_sync()  # DDP's own: gradients stay local, no all-reduce
