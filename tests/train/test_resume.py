"""A run stopped at step k and resumed ends bit-identical to the uninterrupted run."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from mlscale import TrainConfig, UsageError, fit
from mlscale.train.checkpoint import Checkpointer
from tests.helpers import final_weights, run_cli

STEPS, EVERY, STOP = 24, 6, 12


def stop_at(run_dir, step):
    """Make ``run_dir`` look like a run that died right after its checkpoint at ``step``."""
    checkpoints = Checkpointer(run_dir / "checkpoints")
    for s in checkpoints.steps():
        if s > step:
            shutil.rmtree(checkpoints.path_for(s))
    shutil.rmtree(run_dir / "final")
    (run_dir / "report.json").unlink()


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"


def test_single_worker_resume_is_bit_identical(tmp_path):
    config = dict(task="digits-cnn", steps=STEPS, checkpoint_every=EVERY, keep_checkpoints=10, seed=7,
                  optimizer="adam", lr=0.01, warmup_steps=3)
    full = tmp_path / "full"
    fit(TrainConfig(**config, run_dir=str(full)))
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    stop_at(resumed, STOP)
    report = fit(TrainConfig(**config, run_dir=str(resumed), resume=True))
    assert report["resumed_from_step"] == STOP and report["steps"] == STEPS
    assert_bitwise_equal(final_weights(full), final_weights(resumed))


def test_two_worker_resume_is_bit_identical(tmp_path):
    args = ["train", "--task", "digits", "--workers", "2", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
            "--keep-checkpoints", "10", "--batch-size", "16"]
    full = tmp_path / "full"
    assert run_cli(*args, "--run-dir", str(full)).returncode == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    stop_at(resumed, STOP)
    result = run_cli(*args, "--run-dir", str(resumed), "--resume")
    assert result.returncode == 0, result.stderr
    assert_bitwise_equal(final_weights(full), final_weights(resumed))


def test_resume_without_a_checkpoint_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="nothing to resume"):
        fit(TrainConfig(task="digits", steps=2, run_dir=str(tmp_path / "empty"), resume=True))


def test_a_finished_run_dir_is_not_overwritten(tmp_path):
    fit(TrainConfig(task="digits", steps=2, run_dir=str(tmp_path / "run")))
    before = (tmp_path / "run" / "final" / "model.safetensors").read_bytes()
    with pytest.raises(UsageError, match="already holds a run"):
        fit(TrainConfig(task="digits", steps=2, seed=1, run_dir=str(tmp_path / "run")))
    assert (tmp_path / "run" / "final" / "model.safetensors").read_bytes() == before


def _files(run_dir):
    """Every file of a run directory and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    """A finished 1-worker digits-cnn run with checkpoints, as a user's `runs/cnn` would be."""
    run_dir = tmp_path_factory.mktemp("cnn") / "run"
    result = run_cli("train", "--task", "digits-cnn", "--steps", "20", "--checkpoint-every", "10", "--batch-size", "16",
                     "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


def test_resume_from_the_run_directory_alone_takes_the_saved_configuration(cnn_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cnn_run, run_dir)
    result = run_cli("train", "--run-dir", str(run_dir), "--steps", "30", "--resume")
    assert result.returncode == 0, result.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["task"], config["steps"], config["batch_size"], config["workers"]) == ("digits-cnn", 30, 16, 1)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["task"] == "digits-cnn" and report["steps"] == 30 and report["resumed_from_step"] == 20
    # a flag names what it changes, and only that: two workers now, the global batch notice says so
    result = run_cli("train", "--run-dir", str(run_dir), "--steps", "34", "--workers", "2", "--resume", timeout=180)
    assert result.returncode == 0, result.stderr
    assert "global batch 16 -> 32" in result.stderr and "--batch-size 8 keeps it" in result.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["task"], config["steps"], config["batch_size"], config["workers"]) == ("digits-cnn", 34, 16, 2)


@pytest.mark.parametrize(("flags", "code"), [
    (["--batch-size", "100000"], 2),             # refused before anything starts
    (["--task-opt", "channels=4"], 1),           # starts, then the checkpoint does not fit the model
    (["--workers", "2", "--task-opt", "channels=4"], 1),
])
def test_a_refused_or_failed_start_leaves_the_run_directory_byte_identical(flags, code, cnn_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cnn_run, run_dir)
    before = _files(run_dir)
    result = run_cli("train", "--run-dir", str(run_dir), "--steps", "30", "--resume", *flags, timeout=180)
    assert result.returncode == code, result.stderr
    after = {name: data for name, data in _files(run_dir).items() if not name.startswith("logs/")}
    assert after == before, sorted(name for name in after if after[name] != before.get(name))


def test_resume_with_steps_replaces_the_epochs_a_run_was_started_with(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli("train", "--task", "digits", "--epochs", "1", "--run-dir", str(run_dir)).returncode == 0
    result = run_cli("train", "--run-dir", str(run_dir), "--steps", "60", "--resume")
    assert result.returncode == 0, result.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["steps"], config["epochs"]) == (60, None)
    assert json.loads((run_dir / "report.json").read_text())["steps"] == 60


def test_a_run_directory_whose_job_failed_before_any_checkpoint_can_be_run_again(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--task", "digits", "--workers", "2", "--steps", "10", "--run-dir", str(run_dir)]
    failed = run_cli(*args, "--fault", "kill:rank=1:step=3", timeout=180)
    assert failed.returncode == 1 and json.loads((run_dir / "report.json").read_text())["status"] == "failed"
    again = run_cli(*args, timeout=180)
    assert again.returncode == 0, again.stderr


def test_resume_refuses_when_every_checkpoint_is_damaged_instead_of_starting_over(cnn_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cnn_run, run_dir)
    for path in (run_dir / "checkpoints").glob("step_*/__0_0.distcp"):
        path.write_bytes(path.read_bytes()[:100])  # torn
    result = run_cli("train", "--run-dir", str(run_dir), "--steps", "30", "--resume")
    assert result.returncode == 1 and "all 2 are damaged" in result.stderr, result.stderr
    assert json.loads((run_dir / "report.json").read_text())["steps"] == 20  # the run directory kept


def test_a_run_directory_of_the_flat_configuration_of_earlier_versions_resumes(tmp_path):
    """``config.json`` as earlier versions wrote it (one flat table; tests/train/data holds one written by
    them) still resumes, keeps its values, and is rewritten in the nested form."""
    run_dir = tmp_path / "run"
    flat = json.loads((Path(__file__).parent / "data" / "config-flat-v0.json").read_text())
    flat.update(run_dir=str(run_dir), workers=1)
    fit(TrainConfig(**{**flat, "steps": 10}))  # the same options, given flat to the API
    (run_dir / "config.json").write_text(json.dumps(flat))  # the earlier version's file
    stop_at(run_dir, 10)
    report = fit(TrainConfig(run_dir=str(run_dir), steps=20, resume=True))
    assert report["status"] == "completed" and report["steps"] == 20 and report["resumed_from_step"] == 10
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["optim"]["momentum"] == 0.5 and saved["optim"]["lr"] == 0.1 and saved["data"]["data_cache"] == "memory"
    assert saved["steps"] == 20 and saved["batch_size"] == 16
