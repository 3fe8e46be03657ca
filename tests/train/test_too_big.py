"""A model whose weights alone exceed one process's memory: one process fails with the clear message, fsdp
over 4 builds it on the meta device, each rank initialising its own shards, and trains; a training state
too big for one process fits in two pipeline stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import run_cli

# Trained runs of Hugging Face models built by the first test that needs them: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)


def report_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


# -- a model larger than one process -------------------------------------------------------------------------
BIG = ["--task", "tinylm", "--task-opt", "dim=512", "--task-opt", "layers=16", "--task-opt", "samples=64",
       "--batch-size", "4", "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-3", "--steps", "2", "--no-progress",
       "--no-async-checkpoint", "--memory-limit-mb", "180", "--activation-checkpointing", "full"]


def test_a_model_whose_weights_alone_exceed_one_process_starts_sharded(tmp_path):
    # 50M parameters: 192 MB of float32 weights against a 180 MB cap per process. With SGD the state is the
    # weights and their gradients: 4 processes hold half the weights each (2 could not: the whole weights).
    alone = run_cli("train", *BIG, "--run-dir", str(tmp_path / "one"), timeout=180)
    assert alone.returncode == 1 and "ran out of its 180 MB (--memory-limit-mb)" in alone.stderr
    assert "--strategy fsdp" in alone.stderr  # what to do about it
    assert "Traceback" not in alone.stderr
    result = run_cli("train", *BIG, "--strategy", "fsdp", "--workers", "4", "--run-dir", str(tmp_path / "fsdp"),
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(192.5 MB of weights); each rank initialises its own shards" in result.stderr  # auto: too big for one
    for rank in report_of(tmp_path / "fsdp")["memory"]:  # a quarter of the weights and of their gradients each
        assert 0.24 * 2 * 192.5 <= rank["state_mb"] <= 0.26 * 2 * 192.5, rank
    assert "output.weight" in load_file(str(tmp_path / "fsdp" / "final" / "model.safetensors"))


# 25M parameters: 100 MB of weights, 400 MB with gradients and Adam's two moments, against 390 MB a process.
ADAM = ["--task", "tinylm", "--task-opt", "dim=512", "--task-opt", "layers=8", "--task-opt", "samples=64",
        "--batch-size", "4", "--optimizer", "adam", "--lr", "1e-3", "--steps", "2", "--no-progress",
        "--no-async-checkpoint", "--memory-limit-mb", "390", "--microbatches", "2"]


def test_a_training_state_too_big_for_one_process_fits_in_two_pipeline_stages(tmp_path):
    result = run_cli("train", *ADAM, "--strategy", "pipeline", "--workers", "2", "--run-dir", str(tmp_path / "run"),
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(m["state_mb"] < 220 for m in report_of(tmp_path / "run")["memory"])  # about half each
