"""Data parallelism is exact: N workers x batch B == 1 worker x batch N*B (float64)."""

import pytest
import torch

from mlscale import TrainConfig, fit
from mlscale.tasks import make_task
from tests.helpers import final_weights, max_abs_diff, run_cli

STEPS, BATCH = 30, 16


def initial_weights(task: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights every rank starts from: the task's model built under the run's seed."""
    torch.manual_seed(seed)
    model = make_task(task).build_model().to(dtype)
    return {name: t.detach() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def single_worker_runs(tmp_path_factory):
    runs = {}
    for world in (2, 3):
        run_dir = tmp_path_factory.mktemp(f"one-x-{world}")
        fit(TrainConfig(task="digits", workers=1, steps=STEPS, batch_size=world * BATCH, dtype="float64",
                          run_dir=str(run_dir / "run")))
        runs[world] = run_dir / "run"
    return runs


@pytest.mark.parametrize("world", [2, 3])
def test_n_workers_end_with_the_weights_of_one_worker_with_n_times_the_batch(world, tmp_path, single_worker_runs):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "digits", "--workers", str(world), "--steps", str(STEPS),
                     "--batch-size", str(BATCH), "--dtype", "float64", "--run-dir", str(run_dir), timeout=180)
    assert result.returncode == 0, result.stderr
    diff = max_abs_diff(final_weights(run_dir), final_weights(single_worker_runs[world]))
    assert diff <= 1e-10, f"{world} workers differ from 1 worker by {diff:.3e}"
    # and the runs really trained: a broken all-reduce or optimizer would still give equal *initial* weights
    moved = max_abs_diff(final_weights(run_dir), initial_weights("digits", dtype=torch.float64))
    assert moved > 1e-3, f"the weights moved only {moved:.3e} from their initial values"
