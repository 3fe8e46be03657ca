"""Data sharding and loading for training workers."""

from mlscale.data.loader import Position, ShardLoader, steps_per_epoch
from mlscale.data.sampler import ShardedSampler, epoch_order, shard_indices

__all__ = ["Position", "ShardLoader", "ShardedSampler", "epoch_order", "shard_indices", "steps_per_epoch"]
