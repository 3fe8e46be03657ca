import pytest

from mlscale import TrainConfig, fit


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """Two finished runs (digits MLP and CNN), trained once for all registry tests."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for task in ("digits", "digits-cnn"):
        fit(TrainConfig(task=task, steps=30, run_dir=str(root / task)))
        runs[task] = root / task
    return runs
