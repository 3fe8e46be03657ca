"""Gradient accumulation: K micro-steps of B samples, synchronised once, train exactly like batch K x B,
and the all-reduce runs once per optimizer step, not once per micro-step."""

from __future__ import annotations

import json

import pytest

from tests.helpers import final_weights, max_abs_diff, refused, run_cli

BASE = ["train", "--task", "digits", "--dtype", "float64", "--workers", "2", "--steps", "6", "--no-progress"]


def train(run_dir, *extra):
    result = run_cli(*BASE, "--run-dir", str(run_dir), *extra, timeout=180)
    assert result.returncode == 0, result.stderr
    return json.loads((run_dir / "report.json").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulated_micro_steps_train_like_the_large_batch(strategy, tmp_path):
    large = train(tmp_path / "large", "--strategy", strategy, "--batch-size", "16")
    accumulated = train(tmp_path / "accumulated", "--strategy", strategy, "--batch-size", "4", "--grad-accum", "4")
    assert accumulated["samples_seen"] == large["samples_seen"] == 6 * 2 * 16
    assert max_abs_diff(final_weights(tmp_path / "accumulated"), final_weights(tmp_path / "large")) <= 1e-10
    if strategy == "ddp":  # DDP's no_sync on 3 of 4 micro-steps: the same all-reduces per step as one batch
        assert accumulated["communication"]["allreduce_buckets_per_step"] == \
            large["communication"]["allreduce_buckets_per_step"] > 0


def test_a_pipeline_refuses_gradient_accumulation_with_a_pointer_to_microbatches(tmp_path):
    result = refused("train", "--task", "tinylm", "--strategy", "pipeline", "--workers", "2", "--grad-accum", "2",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "not of --strategy pipeline (a pipeline accumulates over its --microbatches" \
        in result.stderr
