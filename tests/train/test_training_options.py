"""What users of Lightning, Accelerate and the Hugging Face Trainer expect of a loop: the gradients'
global norm clipped (also when sharded), and held-out metrics during the run."""

from __future__ import annotations

import json

import torch

from mlscale import TrainConfig, fit
from mlscale.tasks import make_task
from tests.helpers import final_weights, refused, run_cli

LR, CLIP = 0.1, 1e-3


def _update_norm(run_dir) -> float:
    """L2 norm of the change of all weights in the one step the run took (plain SGD: lr x gradient)."""
    torch.manual_seed(0)
    initial = make_task("digits").build_model().state_dict()
    final = final_weights(run_dir)
    return torch.sqrt(sum(((final[k] - initial[k].to(final[k].dtype)) ** 2).sum() for k in final)).item()




def test_clipping_bounds_the_update_by_lr_times_the_norm(tmp_path):
    clipped = dict(task="digits", dtype="float64", steps=1, lr=LR, momentum=0.0, lr_schedule="constant",
                   progress=False)
    fit(TrainConfig(**clipped, clip_grad_norm=CLIP, run_dir=str(tmp_path / "clipped")))
    fit(TrainConfig(**clipped, run_dir=str(tmp_path / "free")))
    assert _update_norm(tmp_path / "clipped") <= LR * CLIP * (1 + 1e-9)
    assert _update_norm(tmp_path / "free") > 10 * LR * CLIP  # the bound is not met by chance


def test_clipping_takes_the_global_norm_of_sharded_gradients(tmp_path):
    config = tmp_path / "sgd.toml"
    config.write_text(f'task = "digits"\ndtype = "float64"\nsteps = 1\nlr = {LR}\nmomentum = 0.0\n'
                      'lr_schedule = "constant"\n')
    result = run_cli("train", "--config", str(config), "--strategy", "fsdp", "--workers", "2", "--batch-size", "16",
                     "--clip-grad-norm", str(CLIP), "--no-progress", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    norm = _update_norm(tmp_path / "run")
    assert 0.99 * LR * CLIP <= norm <= LR * CLIP * (1 + 1e-9)  # clipped to the whole norm, not each shard's


def test_held_out_metrics_during_the_run_in_metrics_and_on_the_console(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "digits", "--strategy", "fsdp", "--workers", "2", "--steps", "20",
                     "--eval-every", "10", "--log-every", "10", "--no-progress", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [at_10] = [line for line in lines if line["step"] == 10]
    [evaluated] = at_10["eval"]
    assert evaluated["step"] == 10 and 0 <= evaluated["accuracy"] <= 1
    assert "eval at step 10: accuracy" in result.stderr
    assert "eval" not in lines[-1]  # the final evaluation is the report's


def test_options_a_strategy_cannot_apply_are_refused(tmp_path):
    result = refused("train", "--task", "tinylm", "--strategy", "pipeline", "--workers", "2", "--clip-grad-norm", "1",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "an option of --strategy ddp or fsdp" in result.stderr


def test_tensorboard_event_files_hold_the_metrics_lines(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "digits", "--workers", "2", "--steps", "30", "--log-every", "10",
                     "--eval-every", "4", "--log", "tensorboard", "--no-progress", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()  # TensorBoard's own reader
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [line["step"] for line in lines] == [10, 20, 30]
    assert all(abs(e.value - line["loss"]) < 1e-6 for e, line in zip(losses, lines))
    assert [e.step for e in events.Scalars("eval/accuracy")] == [4, 8, 12, 16, 20, 24, 28]
    assert [e["step"] for e in lines[0]["eval"]] == [4, 8]  # two evaluations before the first line: both kept
    assert "time/rank1/optimizer_ms" in events.Tags()["scalars"]


def test_a_compiled_model_trains_like_the_eager_one_and_reports_its_compile_step(tmp_path):
    options = dict(task="digits", steps=20, progress=False)
    eager = fit(TrainConfig(**options, run_dir=str(tmp_path / "eager")))
    compiled = fit(TrainConfig(**options, compile=True, run_dir=str(tmp_path / "compiled")))
    a, b = final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")
    assert a.keys() == b.keys()  # compiled in place: the same names (no _orig_mod.), the same checkpoints
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4  # float32, fused kernels round differently
    assert compiled["compile"]["enabled"] and not eager["compile"]["enabled"]
    assert compiled["compile"]["first_step_ms"] > compiled["per_rank"][0]["step_ms_p50"]
