"""Pipelines of models nobody here wrote, on real processes (gloo, float64): Hugging Face GPT-2 (its head
tied to its embedding, a ModelOutput), Llama (in 3 stages split where the user says, its rotary values
handed on past a stage) and a CNN (a dict output, buffers, a parameter outside its blocks) train exactly
what the unsplit model trains, with GPipe and 1F1B and with data-parallel replicas; their checkpoints
resume under ddp and back; what cannot be split is refused in one line before any process starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from mlscale import Task, TensorData, declare_task
from mlscale.train.checkpoint import _SafeReader, read_metadata, step_name
from tests.helpers import final_weights, max_abs_diff, refused, run_cli

# The module's trained runs are built once, by the first test that needs them: that setup takes minutes
# on 2 busy cores, more than the suite's 300 s per test (each run still has its own timeout).
pytestmark = pytest.mark.timeout(900)

GPT2 = ["--task", "tests.user_models:gpt2", "--task-opt", "samples=64"]
LLAMA = ["--task", "tests.user_models:llama", "--task-opt", "samples=64"]
CNN = ["--task", "tests.user_models:cnn", "--task-opt", "samples=128"]
BASE = ["--dtype", "float64", "--optimizer", "adam", "--lr", "3e-3", "--steps", "4", "--batch-size", "8",
        "--checkpoint-every", "2", "--keep-checkpoints", "5", "--no-progress"]
PIPELINE = ["--strategy", "pipeline"]
EXACT = 1e-9
STEPS = 4


def train(run_dir: Path, *args: str, timeout: float = 300) -> str:
    """One run of the CLI (a hang fails the test after ``timeout``); its stderr."""
    result = run_cli("train", *args, *BASE, "--run-dir", str(run_dir), timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stderr


def checkpoint_weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The model's tensors in a run's checkpoint of ``step``, read in this process (DCP, no process group)."""
    path = run_dir / "checkpoints" / step_name(step)
    entries = read_metadata(path).state_dict_metadata
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()
               if key.startswith("model/")}
    dcp.load(tensors, storage_reader=_SafeReader(path), no_dist=True)
    return {key.removeprefix("model/"): value for key, value in tensors.items()}


def trained_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final safetensors where the run could write them, else its last checkpoint's model."""
    final = run_dir / "final" / "model.safetensors"
    return final_weights(run_dir) if final.exists() else checkpoint_weights(run_dir)


def cut_to(run_dir: Path, step: int) -> None:
    """Make ``run_dir`` look like a run that died right after its checkpoint at ``step``."""
    for later in (run_dir / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    shutil.rmtree(run_dir / "final", ignore_errors=True)
    (run_dir / "report.json").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """GPT-2, tied: one worker, and a 2-stage 1F1B pipeline of the same batch."""
    root = tmp_path_factory.mktemp("pipeline-gpt2")
    train(root / "one", *GPT2)
    stderr = train(root / "pipeline", *GPT2, *PIPELINE, "--workers", "2")
    return root, stderr


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """Llama: one worker, and a 3-stage GPipe pipeline split where the user says (--split-points); its
    rotary values, made before the first block, reach the third stage through the second."""
    root = tmp_path_factory.mktemp("pipeline-llama")
    train(root / "one", *LLAMA)
    stderr = train(root / "pipeline", *LLAMA, *PIPELINE, "--stages", "3", "--workers", "3", "--schedule", "gpipe",
                   "--split-points", "model.layers.1,model.layers.3")
    return root, stderr


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory):
    """The CNN: one worker, and three stages (one per block; a middle stage too)."""
    root = tmp_path_factory.mktemp("pipeline-cnn")
    train(root / "one", *CNN)
    stderr = train(root / "pipeline", *CNN, *PIPELINE, "--stages", "3", "--workers", "3")
    return root, stderr


# -- equal to the unsplit model ----------------------------------------------------------------------------
def test_gpt2_with_its_head_tied_to_the_embedding_trains_in_a_pipeline_like_one_worker(gpt2_runs):
    root, stderr = gpt2_runs
    assert "stage 0: transformer.wte, transformer.wpe, transformer.h.0-1" in stderr
    assert "tied across stages 0 and 1, kept in step: transformer.wte.weight = lm_head.weight" in stderr
    pipeline, one = checkpoint_weights(root / "pipeline"), checkpoint_weights(root / "one")
    assert max_abs_diff(pipeline, one) <= EXACT
    # the two stages' copies of the tied weight took the same updates: the checkpoint holds one value
    assert torch.equal(pipeline["lm_head.weight"], pipeline["transformer.wte.weight"])
    assert max_abs_diff(final_weights(root / "pipeline"), final_weights(root / "one")) <= EXACT
    final = final_weights(root / "pipeline")
    assert torch.equal(final["lm_head.weight"], final["transformer.wte.weight"])


def test_gpt2_in_two_stages_times_two_replicas_trains_like_ddp_on_two_workers(tmp_path):
    train(tmp_path / "ddp", *GPT2, "--workers", "2")
    train(tmp_path / "pp-dp", *GPT2, *PIPELINE, "--stages", "2", "--workers", "4", "--schedule", "gpipe")
    assert max_abs_diff(trained_weights(tmp_path / "pp-dp"), trained_weights(tmp_path / "ddp")) <= EXACT


def test_llama_split_where_the_user_says_trains_like_one_worker(llama_runs):
    root, stderr = llama_runs
    assert "stage 0: model.embed_tokens, model.layers.0, model.rotary_emb" in stderr  # the rotary table runs first
    assert "stage 1: model.layers.1-2 (" in stderr and "stage 2: model.layers.3, model.norm, lm_head (" in stderr
    assert max_abs_diff(final_weights(root / "pipeline"), final_weights(root / "one")) <= EXACT
    report = json.loads((root / "pipeline" / "report.json").read_text())["pipeline"]
    assert report["split_points"] == ["model.layers.1", "model.layers.3"] and report["schedule"] == "gpipe"


def test_a_cnn_with_a_dict_output_buffers_and_a_free_parameter_trains_in_three_stages_like_one_worker(cnn_runs):
    root, stderr = cnn_runs
    assert "stage 0: pixel_mean, blocks.0 (" in stderr and "stage 1: blocks.1 (" in stderr
    assert "stage 2: temperature, blocks.2, head (" in stderr  # the free parameter, used last, is the last stage's
    pipeline, one = final_weights(root / "pipeline"), final_weights(root / "one")
    assert "version" in pipeline and "pixel_mean" not in pipeline  # as the unsplit model saves them
    assert max_abs_diff(pipeline, one) <= EXACT


# -- checkpoints --------------------------------------------------------------------------------------------
def test_a_pipeline_checkpoint_resumes_under_ddp_and_a_ddp_checkpoint_as_a_pipeline(gpt2_runs, tmp_path):
    root, _ = gpt2_runs
    layouts = {"pipeline": ["--strategy", "ddp", "--workers", "1"], "one": [*PIPELINE, "--workers", "2"]}
    for source, layout in layouts.items():
        run_dir = tmp_path / f"from-{source}"
        shutil.copytree(root / source, run_dir)
        cut_to(run_dir, 2)
        train(run_dir, *GPT2, *layout, "--resume")
        assert max_abs_diff(checkpoint_weights(run_dir), checkpoint_weights(root / "one")) <= EXACT, source


# -- refused before any process starts ----------------------------------------------------------------------
class _ValueDependent(nn.Module):
    """Blocks whose forward branches on a tensor's value: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:
                x = -x
        return self.head(x)


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features, self.head = nn.Linear(64, 32), nn.Conv1d(1, 10, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).unsqueeze(1)).squeeze(-1)


def _digits_task(build: type[nn.Module]) -> Task:
    from mlscale.tasks.digits import load_digits, split

    train_data, held_out = split(load_digits())
    return Task(name=build.__name__, build_model=build, train=TensorData(train_data.inputs[:64],
                train_data.targets[:64]), eval=held_out)


@declare_task
def value_dependent() -> Task:
    return _digits_task(_ValueDependent)


@declare_task
def no_blocks() -> Task:
    return _digits_task(_NoBlocks)


@pytest.mark.parametrize(("flags", "message"), [
    ([*GPT2, *PIPELINE, "--workers", "2", "--split-points", "transformer.h.9"],
     "the model has no module 'transformer.h.9' (its blocks: transformer.h.0, transformer.h.1, ...)"),
    ([*GPT2, *PIPELINE, "--workers", "2", "--split-points", "transformer.h.1,transformer.h.2"],
     "2 name(s) for --stages 2"),
    ([*GPT2, *PIPELINE, "--stages", "3", "--workers", "3", "--split-points", "transformer.h.2,transformer.h.1"],
     "'transformer.h.1' does not come after 'transformer.h.2'"),
    ([*GPT2, "--workers", "2", "--split-points", "transformer.h.2"], "an option of --strategy pipeline"),
    (["--task", "tests.train.test_pipeline:value_dependent", *PIPELINE, "--workers", "2"],
     "cannot trace this model with torch.export"),
    (["--task", "tests.train.test_pipeline:no_blocks", *PIPELINE, "--workers", "2"], "found no repeated blocks"),
])
def test_what_cannot_be_split_is_refused_in_one_line_before_any_process_starts(flags, message, tmp_path):
    result = refused("train", *flags, "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run" / "logs").exists()
