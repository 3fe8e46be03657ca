"""Models nobody here wrote (tests/user_models.py) sharded by FSDP2: Hugging Face GPT-2 with its head tied
to its embedding, and a CNN with buffers, a scalar parameter and a dict output, each against ddp in
float64, resumed on another layout; activation checkpointing on tinylm and GPT-2's blocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import final_weights, max_abs_diff, refused, run_cli
from tests.train.test_resume import stop_at

# The module's trained runs are built once, by the first test that needs them: that setup takes minutes
# on 2 busy cores, more than the suite's 300 s per test (each run still has its own timeout).
pytestmark = pytest.mark.timeout(900)

EXACT = 1e-9
COMMON = ["--dtype", "float64", "--optimizer", "adam", "--lr", "3e-3", "--steps", "4", "--batch-size", "8",
          "--checkpoint-every", "2", "--keep-checkpoints", "3", "--no-progress"]
GPT2 = ["--task", "tests.user_models:gpt2", "--task-opt", "layers=2"]
CNN = ["--task", "tests.user_models:cnn"]
TINYLM = ["--task", "tinylm", "--task-opt", "dim=32", "--task-opt", "layers=4", "--task-opt", "seq_len=16",
          "--task-opt", "samples=256"]


def train(run_dir: Path, *args: str, expect: int = 0, timeout: float = 240):
    result = run_cli("train", *COMMON, "--run-dir", str(run_dir), *args, timeout=timeout)
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def report_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    train(root / "ddp", *GPT2, "--workers", "2")
    train(root / "fsdp", *GPT2, "--strategy", "fsdp", "--workers", "2")
    return root


def test_gpt2_with_tied_embeddings_trains_sharded_like_ddp_and_keeps_its_tie(gpt2):
    fsdp = final_weights(gpt2 / "fsdp")
    assert max_abs_diff(fsdp, final_weights(gpt2 / "ddp")) <= EXACT
    assert (fsdp["lm_head.weight"] == fsdp["transformer.wte.weight"]).all()  # trained as one tensor


def test_gpt2_s_sharded_checkpoint_resumes_on_one_process_with_the_tie_intact(gpt2, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(gpt2 / "fsdp", run_dir)
    stop_at(run_dir, 2)
    train(run_dir, *GPT2, "--workers", "2", "--strategy", "ddp", "--resume")
    resumed = final_weights(run_dir)
    assert max_abs_diff(resumed, final_weights(gpt2 / "ddp")) <= EXACT
    assert (resumed["lm_head.weight"] == resumed["transformer.wte.weight"]).all()


def test_gpt2_says_in_one_line_why_tensor_parallelism_cannot_split_it(tmp_path):
    result = refused("train", *GPT2, "--strategy", "tp", "--workers", "2", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "name no module of GPT2LMHeadModel" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_a_cnn_with_buffers_and_a_dict_output_trains_sharded_like_ddp(tmp_path):
    train(tmp_path / "ddp", *CNN, "--workers", "2")
    train(tmp_path / "fsdp", *CNN, "--strategy", "fsdp", "--workers", "2")
    sharded = final_weights(tmp_path / "fsdp")
    assert max_abs_diff(sharded, final_weights(tmp_path / "ddp")) <= EXACT
    assert "version" in sharded and "pixel_mean" not in sharded  # the persistent buffer only
    assert report_of(tmp_path / "fsdp")["eval"]["accuracy"] > 0


# -- activation checkpointing --------------------------------------------------------------------------------
def test_activation_checkpointing_changes_no_weight_and_keeps_fewer_activations(tmp_path, gpt2):
    train(tmp_path / "none", *TINYLM)
    train(tmp_path / "full", *TINYLM, "--activation-checkpointing", "full")
    assert max_abs_diff(final_weights(tmp_path / "full"), final_weights(tmp_path / "none")) <= 1e-12
    kept = {name: report_of(tmp_path / name)["memory"][0]["activations_mb"] for name in ("none", "full")}
    assert kept["full"] < 0.25 * kept["none"]
    # A Hugging Face model's blocks (called with keyword arguments), every second one, sharded:
    train(tmp_path / "hf", *GPT2, "--strategy", "fsdp", "--workers", "2", "--activation-checkpointing",
          "selective", "--ac-every", "2")
    assert max_abs_diff(final_weights(tmp_path / "hf"), final_weights(gpt2 / "fsdp")) <= 1e-12
    assert report_of(tmp_path / "hf")["memory"][0]["activations_mb"] < report_of(gpt2 / "fsdp")["memory"][0][
        "activations_mb"]


