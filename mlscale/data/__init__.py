"""Data sharding and loading for training workers.

The names are imported on first use: a process that reads only documents (``data.tokens``, in a tokenizing
process) never loads torch through this ``__init__``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlscale.common.lazy import lazy_names

if TYPE_CHECKING:
    from mlscale.data.loader import Position, ShardLoader, steps_per_epoch
    from mlscale.data.sampler import ShardedSampler, epoch_order, shard_indices

__all__ = ["Position", "ShardLoader", "ShardedSampler", "epoch_order", "shard_indices", "steps_per_epoch"]

__getattr__, __dir__ = lazy_names(__name__, {
    "Position": "mlscale.data.loader", "ShardLoader": "mlscale.data.loader", "steps_per_epoch": "mlscale.data.loader",
    "ShardedSampler": "mlscale.data.sampler", "epoch_order": "mlscale.data.sampler",
    "shard_indices": "mlscale.data.sampler"})
