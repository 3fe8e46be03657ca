"""Models nobody here wrote (tests/user_models.py) split by tensor parallelism: a Hugging Face Llama by
its own plan under tp and fsdp x tp, against the unsplit model in float64, resumed across layouts, with a
tied head, and filled by its own init on the meta device; GPT-2 and Llama wrapped in a user's module (the
nested model's plan found under its path; pipeline stages sending contiguous tensors). (GPT-2 and a CNN
under fsdp, and activation checkpointing: test_user_models_sharded.py; a model larger than one process:
test_too_big.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import final_weights, max_abs_diff, refused, run_cli
from tests.train.test_resume import stop_at

# The module's trained runs are built once, by the first test that needs them: that setup takes minutes
# on 2 busy cores, more than the suite's 300 s per test (each run still has its own timeout).
pytestmark = pytest.mark.timeout(900)

EXACT = 1e-9
COMMON = ["--dtype", "float64", "--optimizer", "adam", "--lr", "3e-3", "--steps", "4", "--batch-size", "8",
          "--checkpoint-every", "2", "--keep-checkpoints", "3", "--no-progress"]
LLAMA = ["--task", "tests.user_models:llama", "--task-opt", "layers=2"]


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




WRAPPED_LLAMA = [*LLAMA, "--task-opt", "wrapped=true"]
WRAPPED_GPT2 = ["--task", "tests.user_models:gpt2", "--task-opt", "layers=2", "--task-opt", "wrapped=true"]


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """Llama inside a user's module by one process, tp on 2, fsdp x tp on 2 and a 2-stage pipeline; GPT-2
    inside one by one process and a 2-stage pipeline (its tied head across the stages)."""
    root = tmp_path_factory.mktemp("wrapped")
    train(root / "llama-one", *WRAPPED_LLAMA)
    results = {name: train(root / f"llama-{name}", *WRAPPED_LLAMA, *flags, "--workers", "2")
               for name, flags in (("tp", ["--strategy", "tp"]), ("fsdp-tp", ["--strategy", "fsdp", "--tp", "2"]),
                                   ("pipeline", ["--strategy", "pipeline"]))}
    train(root / "gpt2-one", *WRAPPED_GPT2)
    train(root / "gpt2-pipeline", *WRAPPED_GPT2, "--strategy", "pipeline", "--workers", "2")
    return root, results


def test_a_llama_wrapped_in_a_users_module_splits_by_its_nested_plan_like_one_process(wrapped):
    """Its ``_tp_plan`` is relative to itself: found below the user's module and prefixed with its path."""
    root, results = wrapped
    assert "tensor-parallel plan from the model (LlamaForCausalLM._tp_plan) at lm:" in results["tp"].stderr
    for layout in ("tp", "fsdp-tp", "pipeline"):
        assert max_abs_diff(final_weights(root / f"llama-{layout}"), final_weights(root / "llama-one")) <= EXACT, layout
    split = json.loads((root / "llama-tp" / "plan.json").read_text())
    assert split["mesh"]["tp"] == 2


def test_a_gpt2_wrapped_in_a_users_module_trains_as_a_pipeline_like_one_process(wrapped):
    root, _ = wrapped
    assert max_abs_diff(final_weights(root / "gpt2-pipeline"), final_weights(root / "gpt2-one")) <= EXACT


def test_mlscale_plan_finds_the_nested_plan_too():
    result = refused("plan", *WRAPPED_LLAMA, "--strategy", "tp", "--workers", "2")
    assert result.returncode == 0 and "tp 2" in result.stdout, result.stderr


def test_a_stage_handing_on_a_view_sends_it_contiguous_and_trains_like_one_process(tmp_path):
    """Blocks written sequence-first hand their output back transposed: gloo refused the stage's buffer
    ("input tensor has to be contiguous") in the first step."""
    seqfirst = ["--task", "tests.user_models:seqfirst"]
    train(tmp_path / "one", *seqfirst)
    for schedule in ("1f1b", "gpipe"):
        train(tmp_path / schedule, *seqfirst, "--strategy", "pipeline", "--workers", "2", "--schedule", schedule)
        assert max_abs_diff(final_weights(tmp_path / schedule), final_weights(tmp_path / "one")) <= EXACT, schedule
