import pytest
import torch

from mlscale.data import Position, ShardLoader
from mlscale.errors import UsageError
from mlscale.tasks import TensorData


def data(n=50):
    return TensorData(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def take(loader, k):
    return [next(loader)[1].tolist() for _ in range(k)]


def test_a_loader_restored_at_its_position_continues_the_same_stream():
    full = ShardLoader(data(), rank=1, world=2, step_batch=4, seed=3)
    first = take(full, 9)  # crosses an epoch boundary (6 steps per epoch)
    head = ShardLoader(data(), rank=1, world=2, step_batch=4, seed=3)
    take(head, 4)
    tail = ShardLoader(data(), rank=1, world=2, step_batch=4, seed=3, position=head.position)
    assert take(tail, 5) == first[4:]


def test_position_counts_global_samples_and_epochs():
    loader = ShardLoader(data(), rank=0, world=2, step_batch=4, seed=0)
    take(loader, 6)
    assert loader.position == Position(epoch=0, offset=48)
    take(loader, 1)
    assert loader.position == Position(epoch=1, offset=8)


def test_a_batch_larger_than_the_data_is_refused():
    with pytest.raises(UsageError, match="batch-size=8: 8 per worker x 2 worker"):
        ShardLoader(data(10), rank=0, world=2, step_batch=8, seed=0)
