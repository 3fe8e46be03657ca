"""What only a GPU host can show: bf16 autocast, the CUDA memory cap, FSDP2's CPU offload, equivalence on NCCL
and serving workers scaling over many cores.

Marked ``gpu`` and run by ``make test-gpu``; without CUDA (or with fewer GPUs than a test needs: NCCL
gives every rank its own device) each test is skipped, saying why. On a CPU host the same behaviours are
tested on gloo by the rest of the suite; these check that the code paths that differ on CUDA (NCCL
collectives, the caching allocator's cap, pinned host copies) hold too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import final_weights, max_abs_diff, run_cli

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device (none here)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"NCCL needs a device per rank: 2 CUDA devices, {GPUS} here")

TINYLM = ["--task", "tinylm", "--task-opt", "dim=64", "--task-opt", "layers=4", "--task-opt", "seq_len=32",
          "--task-opt", "samples=512", "--batch-size", "8", "--optimizer", "adam", "--lr", "3e-3", "--no-progress",
          "--device", "cuda"]
EXACT = ["--dtype", "float64", "--steps", "6"]


def train(run_dir: Path, *args: str, expect: int = 0):
    result = run_cli("train", *TINYLM, "--run-dir", str(run_dir), *args, timeout=300)
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def report_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


@one_gpu
def test_bf16_autocast_trains_close_to_fp32_on_cuda(tmp_path):
    train(tmp_path / "fp32", "--steps", "30")
    train(tmp_path / "bf16", "--steps", "30", "--bf16")
    fp32, bf16 = report_of(tmp_path / "fp32"), report_of(tmp_path / "bf16")
    assert bf16["mixed_precision"]["precision"] == "bf16" and bf16["mixed_precision"]["master_weights"] == "float32"
    assert abs(bf16["final_loss"] - fp32["final_loss"]) < 0.1
    assert bf16["final_loss"] < 3.0  # it learned: a uniform guess over the 29 characters is ln 29 = 3.37


@one_gpu
def test_the_cuda_memory_cap_stops_a_model_too_big_for_it(tmp_path):
    big = ["--task-opt", "dim=1024", "--task-opt", "layers=8", "--steps", "1", "--memory-limit-mb", "200"]
    result = train(tmp_path / "big", *big, expect=1)
    assert "ran out of its 200 MB (--memory-limit-mb)" in result.stderr and "Traceback" not in result.stderr


@one_gpu
def test_full_activation_checkpointing_keeps_fewer_activations_on_cuda(tmp_path):
    train(tmp_path / "none", *EXACT)
    train(tmp_path / "full", *EXACT, "--activation-checkpointing", "full")
    assert max_abs_diff(final_weights(tmp_path / "full"), final_weights(tmp_path / "none")) <= 1e-12
    kept = [report_of(tmp_path / name)["memory"][0]["activations_mb"] for name in ("none", "full")]
    assert kept[1] < 0.25 * kept[0]


@two_gpus
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "pipeline"])
def test_every_strategy_on_nccl_trains_like_its_reference(strategy, tmp_path):
    # ddp and fsdp on 2 ranks read 2 shards: their reference is ddp on 2 (gloo would give the same);
    # tp and pipeline compute one replica: theirs is one process.
    reference = ["--workers", "2"] if strategy in ("ddp", "fsdp") else []
    train(tmp_path / "reference", *EXACT, *reference)
    train(tmp_path / strategy, *EXACT, "--strategy", strategy, "--workers", "2")
    assert max_abs_diff(final_weights(tmp_path / strategy), final_weights(tmp_path / "reference")) <= 1e-9


@two_gpus
def test_fsdp_with_cpu_offload_trains_the_same_weights_on_less_gpu_memory(tmp_path):
    train(tmp_path / "fsdp", *EXACT, "--strategy", "fsdp", "--workers", "2")
    train(tmp_path / "offload", *EXACT, "--strategy", "fsdp", "--workers", "2", "--offload", "cpu")
    assert max_abs_diff(final_weights(tmp_path / "offload"), final_weights(tmp_path / "fsdp")) <= 1e-9
    on_gpu = [report_of(tmp_path / name)["memory"][0]["peak_mb"] for name in ("fsdp", "offload")]
    assert on_gpu[1] < on_gpu[0]


@two_gpus
def test_fsdp_over_tensor_parallel_on_nccl_trains_like_ddp(tmp_path):
    if GPUS < 4:
        pytest.skip(f"fsdp x tp needs 4 CUDA devices, {GPUS} here")
    train(tmp_path / "ddp", *EXACT, "--workers", "2")
    train(tmp_path / "fsdp-tp", *EXACT, "--strategy", "fsdp", "--tp", "2", "--workers", "4")
    assert max_abs_diff(final_weights(tmp_path / "fsdp-tp"), final_weights(tmp_path / "ddp")) <= 1e-9


def test_serving_workers_scale_with_the_cores_of_a_big_host(tmp_path):
    """Multi-core serving: 4 workers on 4 cores (the load generator on cores of its own) answer at
    least 0.8 x 4 x what one worker answers at p99 <= 50 ms. Needs 8 usable cores (a GPU host's)."""
    import os

    cores = len(os.sched_getaffinity(0))
    if cores < 8:
        pytest.skip(f"needs 8 cores (4 for the workers, the rest for the load generator), {cores} here")
    result = run_cli("bench", "serve-scale", "--quick", "--systems", "mlscale", "--workers", "1,4",
                     "--loadgen-cpus", str(cores - 4), "--split-requests", "1000", "--out", str(tmp_path), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)  # the figures, for the session's note
    scaling = json.loads((tmp_path / "serve-scale.json").read_text())["scaling"]["mlscale"]
    assert scaling["4"]["goodput"] >= 0.8 * 4 * scaling["1"]["goodput"], scaling


@one_gpu
def test_a_dataset_of_dict_inputs_trains_on_cuda_with_data_workers_as_on_the_cpu(tmp_path):
    """A user's Dataset (dict inputs of different lengths, padded per batch) through 2 DataLoader workers with
    pinned memory onto the GPU: the same weights as the CPU run in float64."""
    own = ["--task", "tests.own_data:sentences", "--dtype", "float64", "--steps", "6", "--batch-size", "16",
           "--optimizer", "adam", "--lr", "3e-3", "--no-progress"]
    for device in ("cpu", "cuda"):
        result = run_cli("train", *own, "--device", device, "--data-workers", "2", "--run-dir", str(tmp_path / device),
                         timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert max_abs_diff(final_weights(tmp_path / "cuda"), final_weights(tmp_path / "cpu")) <= 1e-9
