"""A model whose weights alone exceed one process's memory: one process fails with the clear message, fsdp
over 4, and over 2 with --optimizer-in-backward, builds it on the meta device, each rank initialising its
own shards, and trains; a training state too big for one process fits in two pipeline stages."""

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
# 54M parameters: 216.6 MB of float32 weights against a 200 MB cap per process. With SGD (no momentum) the
# training state is the weights and their gradients, so on 2 processes half the weights and half their
# gradients would be the whole weights again: 2 hold it only with --optimizer-in-backward (a block's
# gradients at a time), 4 without.
WEIGHTS_MB = 216.6
BIG = ["--task", "tinylm", "--task-opt", "dim=384", "--task-opt", "layers=32", "--task-opt", "samples=64",
       "--batch-size", "4", "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-3", "--steps", "2", "--no-progress",
       "--no-async-checkpoint", "--memory-limit-mb", "200", "--activation-checkpointing", "full"]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    return run_cli("train", *BIG, "--run-dir", str(tmp_path_factory.mktemp("alone") / "one"), timeout=180)


def test_a_model_whose_weights_alone_exceed_one_process_fails_there_in_one_paragraph(alone):
    assert alone.returncode == 1 and "ran out of its 200 MB (--memory-limit-mb)" in alone.stderr
    assert "--strategy fsdp" in alone.stderr  # what to do about it
    assert "Traceback" not in alone.stderr


@pytest.mark.parametrize(("workers", "flags", "state_share"), [
    (4, [], 2 * 0.25),  # a quarter of the weights and a quarter of their gradients
    (2, ["--optimizer-in-backward"], 0.5),  # half the weights; each gradient freed once its shard is updated
], ids=["fsdp-4", "fsdp-2-optimizer-in-backward"])
def test_it_starts_sharded_and_trains(alone, tmp_path, workers, flags, state_share):
    result = run_cli("train", *BIG, "--strategy", "fsdp", "--workers", str(workers), *flags,
                     "--run-dir", str(tmp_path / "fsdp"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"({WEIGHTS_MB} MB of weights); each rank initialises its own shards" in result.stderr  # auto: too big
    for rank in report_of(tmp_path / "fsdp")["memory"]:
        assert (state_share - 0.01) * WEIGHTS_MB <= rank["state_mb"] <= (state_share + 0.01) * WEIGHTS_MB, rank
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
