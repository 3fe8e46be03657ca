import os
import subprocess
import sys

import torch

from mlscale.tasks import make_task
from tests.helpers import REPO


def test_digits_is_the_real_uci_set_split_80_20():
    task = make_task("digits")
    assert len(task.train) + len(task.eval) == 1797
    assert task.train.inputs.shape[1] == 64 and task.train.inputs.min() >= 0 and task.train.inputs.max() <= 1
    assert set(task.train.targets.tolist()) == set(range(10))


def test_every_builtin_model_maps_inputs_to_outputs():
    for name, options in [("digits", {}), ("digits-cnn", {}), ("synthetic", {"samples": 64}),
                          ("synthetic", {"kind": "regression", "samples": 64})]:
        task = make_task(name, options)
        outputs = task.build_model()(task.train.inputs[:4])
        assert task.loss_fn(outputs, task.train.targets[:4]).isfinite()


def test_synthetic_is_deterministic():
    a, b = make_task("synthetic", {"samples": 32}), make_task("synthetic", {"samples": 32})
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.train.targets, b.train.targets)


def test_the_custom_task_example_trains_from_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mlscale", "train", "--task", "examples.custom_task:make_task", "--task-opt",
         "hidden=32", "--steps", "20", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": "."})
    assert result.returncode == 0, result.stderr
    assert "examples.custom_task:make_task" in result.stdout and "mse" in result.stdout
