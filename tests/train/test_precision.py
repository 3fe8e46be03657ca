"""Mixed precision, proven: fp32 master weights under autocast, fp16's dynamic loss scaler skips a step
with inf gradients and halves its scale, bf16 on a CPU trains like fp32, and autocast halves what
autograd keeps for backward."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mlscale import TrainConfig, fit
from mlscale.train.strategy import Learner
from tests.helpers import final_weights, run_cli


def _learner(model: nn.Module, precision: str) -> Learner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Learner(optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                   scaler=torch.amp.GradScaler("cpu", enabled=precision == "fp16"), precision=precision,
                   device_type="cpu")


def test_an_inf_gradient_under_fp16_skips_the_step_and_halves_the_scale():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    learner = _learner(model, "fp16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = learner.scaler.get_scale()
    learner.poison_next = True
    with learner.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    learner.backward(loss)
    learner.apply()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the step was applied"
    assert learner.scaler.get_scale() == scale / 2 and learner.skipped_steps == 1
    with learner.autocast():  # the next good step is applied, at the halved scale
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    learner.backward(loss)
    learner.apply()
    assert not torch.equal(before["weight"], model.weight) and learner.skipped_steps == 1


def test_fp16_training_gets_past_an_injected_inf_gradient(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "digits", "--workers", "2", "--steps", "60", "--fp16", "--no-progress",
                     "--fault", "inf_grad:rank=1:step=5", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "report.json").read_text())
    # rank 1's inf reached rank 0 through the all-reduce: both skipped that step, once
    assert report["mixed_precision"] == {"precision": "fp16", "master_weights": "float32", "loss_scale": 32768.0,
                                         "skipped_steps": 1}
    assert report["final_loss"] < 2.0  # finite, and it trained on (from ln 10 = 2.3)


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    reports = {}
    for precision in ("fp32", "bf16"):
        reports[precision] = fit(TrainConfig(task="digits", steps=120, batch_size=256, lr=0.1, precision=precision,
                                             progress=False, run_dir=str(root / precision)))
    return root, reports


def test_bf16_on_a_cpu_trains_like_fp32_with_fp32_master_weights(precision_runs):
    root, reports = precision_runs
    fp32, bf16 = reports["fp32"], reports["bf16"]
    assert abs(bf16["eval"]["loss"] - fp32["eval"]["loss"]) <= 0.05 * fp32["eval"]["loss"]
    assert abs(bf16["eval"]["accuracy"] - fp32["eval"]["accuracy"]) <= 0.02
    assert bf16["mixed_precision"]["master_weights"] == "float32"
    assert all(t.dtype == torch.float32 for t in final_weights(root / "bf16").values())


def test_autocast_halves_the_activations_autograd_keeps(precision_runs):
    _, reports = precision_runs
    fp32, bf16 = (reports[p]["memory"][0]["activations_mb"] for p in ("fp32", "bf16"))
    assert fp32 > 0 and 0.4 <= bf16 / fp32 <= 0.7, (fp32, bf16)
