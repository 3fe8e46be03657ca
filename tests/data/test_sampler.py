"""Properties of the sharding sampler over random data sizes, world sizes, seeds and offsets."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlscale.data import ShardedSampler, epoch_order, shard_indices

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
