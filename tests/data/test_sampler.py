"""Properties of the sharding sampler over random data sizes, world sizes, seeds and offsets; for data stored in
shards, also that a rank reads only its own shards."""

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlscale.data import ShardedSampler, epoch_order, shard_indices
from mlscale.data.sampler import PARTITIONS

sizes = st.integers(min_value=0, max_value=500)
worlds = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
epochs = st.integers(min_value=0, max_value=50)


def shards(size, world, seed, epoch, start=0, drop_last=True):
    return [shard_indices(size, r, world, seed=seed, epoch=epoch, start=start, drop_last=drop_last).tolist()
            for r in range(world)]


@settings(max_examples=200, deadline=None)
@given(sizes, worlds, seeds, epochs, st.booleans())
def test_shards_are_disjoint_balanced_and_cover_the_data(size, world, seed, epoch, drop_last):
    parts = shards(size, world, seed, epoch, drop_last=drop_last)
    flat = [i for part in parts for i in part]
    assert len(flat) == len(set(flat)), "a sample is in two shards"
    lengths = [len(p) for p in parts]
    if drop_last:
        assert len(set(lengths)) == 1
        assert size - len(flat) < world, "drop_last dropped a full round of samples"
    else:
        assert max(lengths) - min(lengths) <= 1
        assert sorted(flat) == list(range(size))
    assert set(flat) <= set(range(size))


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=500), worlds, seeds, epochs, st.data())
def test_resuming_from_an_offset_reads_exactly_the_rest_of_the_epoch(size, world, seed, epoch, data):
    start = data.draw(st.integers(min_value=0, max_value=size))
    order = epoch_order(size, seed, epoch).tolist()
    rest = [i for part in shards(size, world, seed, epoch, start=start, drop_last=False) for i in part]
    assert sorted(rest) == sorted(order[start:])


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=400), st.integers(min_value=1, max_value=5),
       st.integers(min_value=1, max_value=16), seeds)
def test_step_of_n_workers_reads_the_same_samples_as_one_worker_with_n_times_the_batch(size, world, batch, seed):
    one = shard_indices(size, 0, 1, seed=seed, epoch=0).tolist()
    parts = shards(size, world, seed, 0)
    steps = (size // world) // batch
    for step in range(steps):
        union = sorted(i for part in parts for i in part[step * batch:(step + 1) * batch])
        assert union == sorted(one[step * world * batch:(step + 1) * world * batch])


@given(sizes, seeds, epochs)
def test_order_is_a_function_of_seed_and_epoch_only(size, seed, epoch):
    assert torch.equal(epoch_order(size, seed, epoch), epoch_order(size, seed, epoch))


def test_epochs_are_reshuffled():
    assert not torch.equal(epoch_order(1000, 0, 0), epoch_order(1000, 0, 1))


def test_sampler_works_with_a_dataloader():
    sampler = ShardedSampler(size=10, rank=1, world=3, seed=5)
    loader = torch.utils.data.DataLoader(list(range(10)), sampler=sampler, batch_size=2)
    seen = [int(x) for batch in loader for x in batch]
    assert seen == shard_indices(10, 1, 3, seed=5, epoch=0).tolist()
    assert len(sampler) == 3
    sampler.set_epoch(1, start=3)
    assert list(sampler) == shard_indices(10, 1, 3, seed=5, epoch=1, start=3).tolist()


# Data stored in shards (``shards=``: each sample's shard): the order that keeps a rank on its own shards.

shard_sizes = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30)


def stored(sizes):
    """Shard numbers of samples stored shard after shard, ``sizes[k]`` samples in shard ``k``."""
    return np.repeat(np.arange(len(sizes)), sizes)


@settings(max_examples=150, deadline=None)
@given(shard_sizes, worlds, seeds, epochs, st.data())
def test_a_sharded_order_keeps_every_property_of_the_plain_one(sizes, world, seed, epoch, data):
    shards_of = stored(sizes)
    size = len(shards_of)
    order = epoch_order(size, seed, epoch, shards=shards_of).tolist()
    assert sorted(order) == list(range(size))
    assert torch.equal(epoch_order(size, seed, epoch, shards=shards_of), torch.tensor(order))
    start = data.draw(st.integers(min_value=0, max_value=size))
    parts = [shard_indices(size, r, world, seed=seed, epoch=epoch, start=start, drop_last=False,
                           shards=shards_of).tolist() for r in range(world)]
    assert sorted(i for part in parts for i in part) == sorted(order[start:])
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    batch = data.draw(st.integers(min_value=1, max_value=8))
    one = shard_indices(size, 0, 1, seed=seed, epoch=epoch, shards=shards_of).tolist()
    full = [shard_indices(size, r, world, seed=seed, epoch=epoch, shards=shards_of).tolist() for r in range(world)]
    for step in range((size // world) // batch):
        union = sorted(i for part in full for i in part[step * batch:(step + 1) * batch])
        assert union == sorted(one[step * world * batch:(step + 1) * world * batch])


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_each_rank_reads_its_own_shards_the_same_every_epoch(world):
    shards_of = stored([101] * 97)  # 9,797 samples in 97 shards: pieces cut inside shards, 5 samples left over
    size = len(shards_of)
    read = {}
    for epoch in (0, 1):
        for rank in range(world):
            indices = shard_indices(size, rank, world, seed=4, epoch=epoch, shards=shards_of).numpy()
            read[epoch, rank] = set(shards_of[indices].tolist())
    for rank in range(world):
        assert read[0, rank] == read[1, rank]
        assert len(read[0, rank]) <= 97 / world + PARTITIONS / world + 2  # its pieces' shards, cut ones, left over
    readers = collections.Counter(shard for rank in range(world) for shard in read[0, rank])
    assert sum(count > 1 for count in readers.values()) <= PARTITIONS + 1  # a shard cut between pieces, left over
    plain = {rank: set(shards_of[shard_indices(size, rank, world, seed=4, epoch=0).numpy()].tolist())
             for rank in range(world)}
    assert all(len(shards) == 97 for shards in plain.values())  # the order of in-memory data reads every shard


def test_a_sharded_order_mixes_shards_within_a_batch_and_changes_every_epoch():
    shards_of = stored([50] * 48)
    first, second = (epoch_order(len(shards_of), 0, epoch, shards=shards_of) for epoch in (0, 1))
    assert not torch.equal(first, second)
    assert len(set(shards_of[first[:64].numpy()].tolist())) >= PARTITIONS  # a batch of 64 draws from 24 pieces
