"""A run checkpointed with N workers resumes with M != N: weights, optimizer state and the data
position carry over, so no sample of the epoch is seen twice or skipped."""

import shutil

import pytest
import torch

from mlscale import TrainConfig, fit
from mlscale.data import Position, ShardLoader, epoch_order
from mlscale.tasks import TensorData
from tests.helpers import final_weights, max_abs_diff, run_cli
from tests.train.test_resume import stop_at

STEPS, STOP, GLOBAL_BATCH = 24, 12, 32


def train_cli(run_dir, workers, *extra):
    result = run_cli("train", "--task", "digits", "--dtype", "float64", "--steps", str(STEPS), "--checkpoint-every",
                     str(STOP), "--workers", str(workers), "--batch-size", str(GLOBAL_BATCH // workers),
                     "--run-dir", str(run_dir), *extra, timeout=180)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def one_worker_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("elastic") / "one"
    fit(TrainConfig(task="digits", dtype="float64", steps=STEPS, checkpoint_every=STOP, batch_size=GLOBAL_BATCH,
                    run_dir=str(run_dir)))
    return run_dir


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resuming_with_another_worker_count_continues_the_same_run(before, after, tmp_path, one_worker_run):
    run_dir = tmp_path / "run"
    if before == 1:
        shutil.copytree(one_worker_run, run_dir)
    else:
        train_cli(run_dir, before)
    stop_at(run_dir, STOP)
    result = train_cli(run_dir, after, "--resume")
    report_text = (run_dir / "report.json").read_text()
    assert f'"resumed_from_world_size": {before}' in report_text and f'"world_size": {after}' in report_text
    diff = max_abs_diff(final_weights(run_dir), final_weights(one_worker_run))
    assert diff <= 1e-10, f"{before} -> {after} workers differs from 1 worker throughout by {diff:.3e}"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (3, 2), (2, 5)])
def test_no_sample_is_seen_twice_or_skipped_across_a_change_of_worker_count(before, after):
    size, batch = 103, 4
    data = TensorData(inputs=torch.arange(size).unsqueeze(1), targets=torch.arange(size))
    seen = []
    loaders = [ShardLoader(data, rank=r, world=before, step_batch=batch, seed=9) for r in range(before)]
    for _ in range(3):
        for loader in loaders:
            seen += next(loader)[1].tolist()
    position = loaders[0].position
    assert position == Position(epoch=0, offset=3 * batch * before)
    loaders = [ShardLoader(data, rank=r, world=after, step_batch=batch, seed=9, position=position)
               for r in range(after)]
    while loaders[0].position.epoch == 0:
        steps_left = (size - loaders[0].position.offset) // after // batch
        if steps_left == 0:
            break
        for loader in loaders:
            seen += next(loader)[1].tolist()
    assert len(seen) == len(set(seen)), "a sample was seen twice in the epoch"
    order = epoch_order(size, 9, 0).tolist()
    assert seen and set(seen) == set(order[: len(seen)]), "a sample was skipped"
    assert size - len(seen) < after * batch + before * batch  # only the incomplete tail is dropped
