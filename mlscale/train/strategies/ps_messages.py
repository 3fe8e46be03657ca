"""What travels between parameter-server workers and servers, as tensors.

A message is a fixed-size float64 control tensor (on the gloo side group, so it can be received from
any rank, and on CPU whatever the device) and, where it carries weights, one flat tensor per server
shard (on the job's own group: nccl on GPU). State sent between servers (checkpoints, the final
model) is serialised with ``torch.save`` and read back with ``torch.load(weights_only=True)``:
tensors and plain containers only, never code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``, end to end."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def empty_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A buffer the size of ``flat(tensors)``, to receive into."""
    first = tensors[0]
    return torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)


def unflatten_into(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``buffer`` back into ``tensors`` (the inverse of ``flat``)."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(buffer[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


@dataclass(frozen=True)
class Header:
    """A worker's push: which step its gradient is for, where its data stands, what the step cost."""

    clock: int  # gradients this worker pushed before this one (in this attempt)
    version: int  # the global step of the parameters the gradient was computed on
    epoch: int  # the worker's data position after this batch
    offset: int
    loss: float
    compute_ms: float
    data_ms: float
    comm_ms: float  # the push and pull of the worker's previous step
    samples: int

    SIZE: ClassVar[int] = 9

    def encode(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def decode(cls, values: torch.Tensor) -> Header:
        raw = values.tolist()
        kinds = [f.type for f in fields(cls)]
        return cls(*(int(v) if kind == "int" else float(v) for v, kind in zip(raw, kinds)))

    @classmethod
    def receive_any(cls, group: Any) -> tuple[int, Header]:
        """The next header from whichever worker sends first (gloo receives from any rank)."""
        buffer = torch.empty(cls.SIZE, dtype=torch.float64)
        sender = dist.recv(buffer, group=group)
        return sender, cls.decode(buffer)


@dataclass(frozen=True)
class Reply:
    """Server 0's answer to a push: the global step of the parameters that follow, or the end."""

    version: int
    done: bool

    def send(self, dst: int, group: Any) -> dist.Work:
        return dist.isend(torch.tensor([self.version, float(self.done)], dtype=torch.float64), dst=dst, group=group)

    @classmethod
    def receive(cls, group: Any) -> Reply:
        buffer = torch.empty(2, dtype=torch.float64)
        dist.recv(buffer, src=0, group=group)
        return cls(version=int(buffer[0].item()), done=bool(buffer[1].item()))
