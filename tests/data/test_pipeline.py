"""The input pipeline (DataLoader worker processes, prefetch, transform, shared cache) delivers exactly
the ShardLoader's batches at exactly its positions, so runs and resumes are the same with any number of
workers."""

from __future__ import annotations

import json

import pytest
import torch

from mlscale.data import Position, ShardLoader
from mlscale.data.pipeline import PipelineLoader
from mlscale.tasks import TensorData
from tests.helpers import final_weights, run_cli
from tests.train.test_resume import stop_at


def _data(size: int = 50) -> TensorData:
    return TensorData(inputs=torch.arange(size, dtype=torch.float64).unsqueeze(1), targets=torch.arange(size))


def _double(sample: torch.Tensor) -> torch.Tensor:
    return sample * 2


@pytest.mark.parametrize(("rank", "world", "start"), [(0, 1, Position()), (1, 2, Position(epoch=1, offset=12))])
def test_workers_deliver_the_shard_loaders_batches_and_positions(rank, world, start):
    options = dict(rank=rank, world=world, batch_size=3, seed=5)
    reference = ShardLoader(_data(), position=start, **options)
    pipeline = PipelineLoader(_data(), position=start, workers=2, prefetch=2, **options)
    try:
        for _ in range(25):  # past two epoch boundaries
            (x, y), (px, py) = next(reference), next(pipeline)
            assert torch.equal(y, py) and torch.equal(x, px)
            assert pipeline.position == reference.position
    finally:
        pipeline.close()


def test_the_cache_fills_in_the_first_epoch_and_serves_the_transformed_samples():
    pipeline = PipelineLoader(_data(), rank=0, world=1, batch_size=5, seed=1, workers=2, transform=_double,
                              cache=True)
    try:
        first = [next(pipeline) for _ in range(10)]  # one epoch: 50 samples
        assert bool(pipeline.samples.filled.all())  # written by the worker processes, in shared memory
        assert torch.equal(pipeline.samples.cache[:, 0], torch.arange(50, dtype=torch.float64) * 2)
        again = [next(pipeline) for _ in range(10)]  # from the cache, in the next epoch's order
        assert sorted(torch.cat([x for x, _ in again]).flatten().tolist()) == \
            sorted(torch.cat([x for x, _ in first]).flatten().tolist())
        assert all(torch.equal(x[:, 0], y.double() * 2) for x, y in again)
    finally:
        pipeline.close()


TASK = ["--task", "synthetic", "--task-opt", "transform_rounds=3", "--task-opt", "samples=512", "--dtype", "float64",
        "--steps", "24", "--batch-size", "16", "--checkpoint-every", "8", "--no-progress"]


def test_a_run_and_its_resume_are_the_same_with_any_number_of_data_workers(tmp_path):
    def train(name, *extra):
        result = run_cli("train", *TASK, "--run-dir", str(tmp_path / name), *extra, timeout=180)
        assert result.returncode == 0, result.stderr
        return result

    train("inline")
    train("workers", "--data-workers", "2", "--data-cache")
    reference = final_weights(tmp_path / "inline")
    assert all(torch.equal(reference[k], v) for k, v in final_weights(tmp_path / "workers").items())
    stop_at(tmp_path / "workers", 16)  # mid-epoch (512 samples = 32 steps of 16)
    train("workers", "--resume")
    assert all(torch.equal(reference[k], v) for k, v in final_weights(tmp_path / "workers").items())
    report = json.loads((tmp_path / "workers" / "report.json").read_text())
    assert report["data"] == {"workers": 2, "prefetch": 2, "cache": True, "transform": True}
    chosen = train("auto", "--data-workers", "auto", "--steps", "4")
    assert "--data-workers auto picked" in chosen.stderr
