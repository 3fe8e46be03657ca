import pytest

from mlscale import TrainConfig, fit
from tests.helpers import shared_copy


def _train(root):
    for task in ("digits", "digits-cnn"):
        fit(TrainConfig(task=task, steps=30, run_dir=str(root / task)))


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """Two finished runs (digits MLP and CNN), trained once for all registry tests; each pytest-xdist
    worker gets its own copy (registering a run writes its report)."""
    root = shared_copy(tmp_path_factory, "runs", _train)
    return {task: root / task for task in ("digits", "digits-cnn")}
