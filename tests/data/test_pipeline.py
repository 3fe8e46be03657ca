"""The input pipeline (DataLoader worker processes, prefetch, transform, shared cache) delivers exactly
the ShardLoader's batches at exactly its positions, so runs and resumes are the same with any number of
workers."""

from __future__ import annotations

import json

import pytest
import torch

from mlscale.data import Position, ShardLoader
from mlscale.data.pipeline import PipelineLoader, SampleCache
from mlscale.tasks import TensorData
from tests.helpers import final_weights, run_cli
from tests.train.test_resume import stop_at


def _data(size: int = 50) -> TensorData:
    return TensorData(inputs=torch.arange(size, dtype=torch.float64).unsqueeze(1), targets=torch.arange(size))


def _double(sample: torch.Tensor) -> torch.Tensor:
    return sample * 2


@pytest.mark.parametrize(("rank", "world", "start"), [(0, 1, Position()), (1, 2, Position(epoch=1, offset=12))])
def test_workers_deliver_the_shard_loaders_batches_and_positions(rank, world, start):
    options = dict(rank=rank, world=world, step_batch=3, seed=5)
    reference = ShardLoader(_data(), position=start, **options)
    pipeline = PipelineLoader(_data(), position=start, workers=2, prefetch=2, **options)
    try:
        for _ in range(25):  # past two epoch boundaries
            (x, y), (px, py) = next(reference), next(pipeline)
            assert torch.equal(y, py) and torch.equal(x, px)
            assert pipeline.position == reference.position
    finally:
        pipeline.close()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_the_cache_fills_in_the_first_epoch_and_serves_the_transformed_samples(kind, tmp_path):
    def pipeline_over_the_cache() -> PipelineLoader:
        return PipelineLoader(_data(), rank=0, world=1, step_batch=5, seed=1, workers=2, transform=_double,
                              cache=kind, cache_dir=tmp_path / "cache")

    pipeline = pipeline_over_the_cache()
    try:
        first = [next(pipeline) for _ in range(10)]  # one epoch: 50 samples
        cache = pipeline.samples.cache
        assert bool(cache.filled.all())  # written by the worker processes, into shared memory or the files
        assert torch.equal(cache.inputs[:, 0], torch.arange(50, dtype=torch.float64) * 2)
        again = [next(pipeline) for _ in range(10)]  # from the cache, in the next epoch's order
        assert sorted(torch.cat([x for x, _ in again]).flatten().tolist()) == \
            sorted(torch.cat([x for x, _ in first]).flatten().tolist())
        assert all(torch.equal(x[:, 0], y.double() * 2) for x, y in again)
    finally:
        pipeline.close()
    reopened = pipeline_over_the_cache()  # a restarted process
    try:
        assert bool(reopened.samples.cache.filled.all()) == (kind == "disk")
        if kind == "disk":
            assert torch.equal(reopened.samples.cache.inputs, cache.inputs)
    finally:
        reopened.close()


def test_a_disk_cache_of_another_layout_starts_over(tmp_path):
    cache = SampleCache(10, (torch.zeros(3), torch.tensor(0)), tmp_path, source="a")
    cache.write(torch.tensor([1, 2]), torch.ones(2, 3), torch.tensor([4, 5]))
    assert SampleCache(10, (torch.zeros(3), torch.tensor(0)), tmp_path, source="a").hits(torch.tensor([1, 2])).all()
    for shape, source in (((4,), "a"), ((3,), "b")):  # another transformed shape; other files read
        fresh = SampleCache(10, (torch.zeros(shape), torch.tensor(0)), tmp_path, source=source)
        assert not fresh.hits(torch.arange(10)).any()


TASK = ["--task", "synthetic", "--task-opt", "transform_rounds=3", "--task-opt", "samples=512", "--dtype", "float64",
        "--steps", "24", "--batch-size", "16", "--checkpoint-every", "8", "--no-progress"]


def test_a_run_and_its_resume_are_the_same_with_any_number_of_data_workers(tmp_path):
    def train(name, *extra):
        result = run_cli("train", *TASK, "--run-dir", str(tmp_path / name), *extra, timeout=180)
        assert result.returncode == 0, result.stderr
        return result

    train("inline")
    train("workers", "--data-workers", "2", "--data-cache", "disk")
    reference = final_weights(tmp_path / "inline")
    assert all(torch.equal(reference[k], v) for k, v in final_weights(tmp_path / "workers").items())
    stop_at(tmp_path / "workers", 16)  # mid-epoch (512 samples = 32 steps of 16)
    train("workers", "--resume")
    assert all(torch.equal(reference[k], v) for k, v in final_weights(tmp_path / "workers").items())
    report = json.loads((tmp_path / "workers" / "report.json").read_text())
    assert report["data"].pop("input_bound")["data_wait_share"] >= 0  # (whether it is, on busy cores, varies)
    assert report["data"] == {"workers": 2, "threads": 0, "prefetch": 2, "cache": "disk", "transform": True,
                              "source": "memory", "cache_mb": pytest.approx(512 * (64 * 8 + 8 + 1) / 2**20, abs=1e-3)}
    chosen = train("auto", "--data-workers", "auto", "--steps", "4")
    assert "--data-workers auto picked" in chosen.stderr
