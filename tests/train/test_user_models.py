"""Models nobody here wrote (tests/user_models.py: Hugging Face GPT-2 with tied embeddings, Llama with its
own tensor-parallel plan, a CNN with buffers and a dict output) through ddp, fsdp, tp and fsdp x tp, each
against the unsplit model in float64, resumed across layouts; built on the meta device; with activation
checkpointing; and a model whose weights alone exceed one process's memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import final_weights, max_abs_diff, run_cli
from tests.train.test_resume import stop_at

EXACT = 1e-9
COMMON = ["--dtype", "float64", "--optimizer", "adam", "--lr", "3e-3", "--steps", "4", "--batch-size", "8",
          "--checkpoint-every", "2", "--keep-checkpoints", "3", "--no-progress"]
LLAMA = ["--task", "tests.user_models:llama", "--task-opt", "layers=2"]
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
def llama(tmp_path_factory):
    """Llama trained by one process, by ddp on 2, by tp on 2 (its own plan) and by fsdp x tp on 4."""
    root = tmp_path_factory.mktemp("llama")
    train(root / "one", *LLAMA)
    train(root / "ddp", *LLAMA, "--workers", "2")
    results = {"tp": train(root / "tp", *LLAMA, "--strategy", "tp", "--workers", "2"),
               "fsdp-tp": train(root / "fsdp-tp", *LLAMA, "--strategy", "fsdp", "--tp", "2", "--workers", "4")}
    return root, results


def test_llama_splits_by_its_own_plan_and_trains_like_one_process(llama):
    root, results = llama
    assert "tensor-parallel plan from the model (LlamaForCausalLM._tp_plan)" in results["tp"].stderr
    assert max_abs_diff(final_weights(root / "tp"), final_weights(root / "one")) <= EXACT
    tp_memory, one_memory = report_of(root / "tp")["memory"], report_of(root / "one")["memory"]
    assert tp_memory[0]["params_mb"] < 0.75 * one_memory[0]["params_mb"]  # the blocks are split; the rest not


def test_fsdp_over_tensor_parallel_groups_trains_like_ddp(llama):
    root, _ = llama
    assert max_abs_diff(final_weights(root / "fsdp-tp"), final_weights(root / "ddp")) <= EXACT
    report = report_of(root / "fsdp-tp")
    assert report["world_size"] == 4 and report["workers"] == 2  # 2 data shards x 2 tensor-parallel ranks
    plan = json.loads((root / "fsdp-tp" / "plan.json").read_text())
    assert plan["mesh"]["dp_shard"] == 2 and plan["mesh"]["tp"] == 2
    assert all(m["params_mb"] < 0.4 * report_of(root / "ddp")["memory"][0]["params_mb"] for m in report["memory"])


def test_a_fsdp_x_tp_checkpoint_resumes_under_ddp(llama, tmp_path):
    root, _ = llama
    run_dir = tmp_path / "run"
    shutil.copytree(root / "fsdp-tp", run_dir)
    stop_at(run_dir, 2)
    train(run_dir, *LLAMA, "--workers", "2", "--strategy", "ddp", "--resume")  # a 2-D checkpoint into replicas
    assert max_abs_diff(final_weights(run_dir), final_weights(root / "ddp")) <= EXACT


def test_a_tied_head_stays_whole_and_tied_under_tensor_parallelism(tmp_path):
    tied = [*LLAMA, "--task-opt", "tie=true"]
    train(tmp_path / "one", *tied)
    result = train(tmp_path / "tp", *tied, "--strategy", "tp", "--workers", "2")
    assert "lm_head (its weight is tied to another module's)" in result.stderr
    split = final_weights(tmp_path / "tp")
    assert max_abs_diff(split, final_weights(tmp_path / "one")) <= EXACT
    assert torch.equal(split["lm_head.weight"], split["model.embed_tokens.weight"])


def test_a_model_whose_own_init_fills_its_shards_trains(tmp_path):
    result = train(tmp_path / "run", *LLAMA, "--strategy", "tp", "--workers", "2", "--weight-init", "sharded",
                   "--steps", "2")
    assert "each rank initialises its own shards" in result.stderr
    weights = final_weights(tmp_path / "run")
    assert all(value.isfinite().all() for value in weights.values())
    std = weights["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert 0.01 < std < 0.05  # Llama's own init (normal, std 0.02), not uninitialised memory


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
    result = run_cli("train", *GPT2, "--strategy", "tp", "--workers", "2", "--run-dir", str(tmp_path / "run"))
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


# -- a model larger than one process -------------------------------------------------------------------------
BIG = ["--task", "tinylm", "--task-opt", "dim=512", "--task-opt", "layers=16", "--task-opt", "samples=64",
       "--batch-size", "4", "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-3", "--steps", "2", "--no-progress",
       "--no-async-checkpoint", "--memory-limit-mb", "180", "--activation-checkpointing", "full"]


def test_a_model_whose_weights_alone_exceed_one_process_starts_sharded(tmp_path):
    # 50M parameters: 192 MB of float32 weights against a 180 MB cap per process. With SGD the state is the
    # weights and their gradients: 4 processes hold half the weights each (2 could not: the whole weights).
    alone = run_cli("train", *BIG, "--run-dir", str(tmp_path / "one"), timeout=180)
    assert alone.returncode == 1 and "ran out of its 180 MB (--memory-limit-mb)" in alone.stderr
    assert "Traceback" not in alone.stderr
    result = run_cli("train", *BIG, "--strategy", "fsdp", "--workers", "4", "--run-dir", str(tmp_path / "fsdp"),
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(192.5 MB of weights); each rank initialises its own shards" in result.stderr  # auto: too big for one
    for rank in report_of(tmp_path / "fsdp")["memory"]:  # a quarter of the weights and of their gradients each
        assert 0.24 * 2 * 192.5 <= rank["state_mb"] <= 0.26 * 2 * 192.5, rank
    assert "output.weight" in load_file(str(tmp_path / "fsdp" / "final" / "model.safetensors"))
