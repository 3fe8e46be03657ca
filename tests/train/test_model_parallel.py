"""Model parallelism on real processes (gloo): pipeline stages, FSDP2 sharding and tensor parallelism
train exactly what the unsplit model trains (float64), hold the measured share of the memory, resume
and recover from their sharded checkpoints. (Models larger than one process: test_too_big.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mlscale.tasks import make_task
from tests.helpers import final_weights, max_abs_diff, refused, run_cli
from tests.train.test_resume import stop_at

TASK = ["--task", "tinylm", "--task-opt", "dim=32", "--task-opt", "layers=4", "--task-opt", "heads=4",
        "--task-opt", "seq_len=16", "--task-opt", "samples=512"]
BASE = [*TASK, "--dtype", "float64", "--optimizer", "adam", "--lr", "3e-3", "--steps", "8", "--checkpoint-every",
        "4", "--keep-checkpoints", "5", "--no-progress"]
EXACT = 1e-9


def train(run_dir: Path, *extra: str, expect: int = 0, timeout: float = 180):
    result = run_cli("train", *BASE, "--run-dir", str(run_dir), *extra, timeout=timeout)
    assert result.returncode == expect, result.stderr
    return result


def report_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference runs, trained once: one worker with batch 8, and ddp with 2 x 8."""
    root = tmp_path_factory.mktemp("model-parallel")
    train(root / "one", "--batch-size", "8")
    train(root / "ddp", "--workers", "2", "--batch-size", "8")
    return root


@pytest.fixture(scope="module")
def fsdp_run(runs):
    train(runs / "fsdp", "--strategy", "fsdp", "--workers", "2", "--batch-size", "8")
    return runs / "fsdp"


@pytest.fixture(scope="module")
def pipeline_run(runs):
    result = train(runs / "pipeline", "--strategy", "pipeline", "--workers", "2", "--batch-size", "8",
                   "--schedule", "1f1b")
    return runs / "pipeline", result


# -- one step, in two processes: gradients and loss of each schedule against the unsplit model -------------
def _stage_gradients(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from mlscale.train.stages import plan_stages, split_model

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    task = make_task("tinylm", {"dim": 32, "layers": 4, "heads": 4, "seq_len": 16, "samples": 64})
    inputs, targets = task.train.inputs[:8], task.train.targets[:8]
    results = {}
    for name, schedule_type in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch.manual_seed(0)
        model = task.build_model().double()
        split = split_model(model, plan_stages(model, 2), inputs[:2])  # traced on one microbatch
        stage_model = split.stage_module(rank)
        schedule = schedule_type(split.take_stage(rank, torch.device("cpu")), n_microbatches=4, loss_fn=task.loss_fn)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
            results[f"{name}/loss"] = torch.stack(losses).mean().reshape(1)
        results.update({f"{name}/{k}": p.grad for k, p in stage_model.named_parameters()})
    save_file(results, f"{out}/rank{rank}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def test_pipeline_stages_compute_the_gradients_and_loss_of_the_unsplit_model(tmp_path):
    context = mp.start_processes(_stage_gradients, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                                 join=False, start_method="spawn")
    for _ in range(120):  # a hung pipeline fails the test within two minutes
        if context.join(timeout=1):
            break
    else:
        for process in context.processes:
            process.kill()
        pytest.fail("the pipeline stages did not finish in 120 s")
    stages = {**load_file(str(tmp_path / "rank0.safetensors")), **load_file(str(tmp_path / "rank1.safetensors"))}

    task = make_task("tinylm", {"dim": 32, "layers": 4, "heads": 4, "seq_len": 16, "samples": 64})
    torch.manual_seed(0)
    model = task.build_model().double()
    loss = task.loss_fn(model(task.train.inputs[:8]), task.train.targets[:8])
    loss.backward()
    for schedule in ("gpipe", "1f1b"):
        assert abs(stages[f"{schedule}/loss"].item() - loss.item()) <= EXACT
        for name, param in model.named_parameters():
            diff = (stages[f"{schedule}/{name}"] - param.grad).abs().max().item()
            assert diff <= EXACT, f"{schedule}: gradient of {name} differs by {diff:.2e}"


# -- whole runs through the trainer (GPipe's step is the test above; data-parallel pipelines: test_pipeline.py) --
def test_a_two_stage_pipeline_trains_like_one_worker_with_the_same_batch(runs, pipeline_run):
    run_dir, result = pipeline_run
    assert "stage 0: tok_embeddings, pos_embeddings, layers.0-1" in result.stderr  # the split, shown at start
    assert max_abs_diff(final_weights(run_dir), final_weights(runs / "one")) <= EXACT
    report = report_of(run_dir)
    assert report["pipeline"]["stages"] == 2 and report["pipeline"]["schedule"] == "1f1b"
    assert report["workers"] == 1 and report["world_size"] == 2  # one replica of two processes


@pytest.fixture(scope="module")
def tp_run(runs):
    train(runs / "tp", "--strategy", "tp", "--workers", "2", "--batch-size", "8")
    return runs / "tp"


def test_tensor_parallel_blocks_train_like_one_worker(runs, tp_run):
    assert max_abs_diff(final_weights(tp_run), final_weights(runs / "one")) <= EXACT


def test_a_tensor_parallel_checkpoint_resumes_as_one_plain_worker(runs, tp_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(tp_run, run_dir)
    stop_at(run_dir, 4)
    train(run_dir, "--strategy", "ddp", "--workers", "1", "--resume")  # other layout, other strategy
    assert max_abs_diff(final_weights(run_dir), final_weights(runs / "one")) <= EXACT


def test_fsdp_trains_like_ddp_on_half_the_memory_per_rank(runs, fsdp_run):
    assert max_abs_diff(final_weights(fsdp_run), final_weights(runs / "ddp")) <= EXACT
    sharded, replicated = report_of(fsdp_run)["memory"], report_of(runs / "ddp")["memory"]
    assert [m["rank"] for m in sharded] == [0, 1]
    for mine, theirs in zip(sharded, replicated):
        for key in ("params_mb", "grads_mb", "optimizer_mb", "state_mb"):
            assert 0.45 <= mine[key] / theirs[key] <= 0.6, f"{key}: {mine[key]:.3f} vs ddp's {theirs[key]:.3f} MB"


def test_fsdp_updating_inside_the_backward_pass_trains_like_ddp_and_keeps_no_gradients(runs):
    # Adam, float64: each shard stepped as soon as its gradient is reduced is the same update.
    train(runs / "in-backward", "--strategy", "fsdp", "--workers", "2", "--batch-size", "8", "--optimizer-in-backward")
    assert max_abs_diff(final_weights(runs / "in-backward"), final_weights(runs / "ddp")) <= EXACT
    assert all(rank["grads_mb"] == 0 for rank in report_of(runs / "in-backward")["memory"])


# -- sharded checkpoints ----------------------------------------------------------------------------------
def test_a_checkpoint_holds_one_file_per_rank_and_the_unsplit_models_names(fsdp_run):
    checkpoint = fsdp_run / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rank_00000.json", "rank_00001.json", "trainer.json"]
    from mlscale.train.checkpoint import read_metadata

    names = set(read_metadata(checkpoint).state_dict_metadata)
    assert "model/layers.0.attention.wq.weight" in names and "optimizer/output.weight/exp_avg" in names


def test_fsdp_resumes_at_another_world_size(runs, fsdp_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run, run_dir)
    stop_at(run_dir, 4)
    # 2 x 8 samples a step before, 1 x 16 after: the same global batch, so the same run as ddp's.
    train(run_dir, "--strategy", "fsdp", "--workers", "1", "--batch-size", "16", "--resume")
    assert report_of(run_dir)["resumed_from_world_size"] == 2
    assert max_abs_diff(final_weights(run_dir), final_weights(runs / "ddp")) <= EXACT


@pytest.mark.parametrize(("strategy", "rank"), [("fsdp", 0), ("pipeline", 1)])
def test_a_killed_rank_is_recovered_bitwise(strategy, rank, tmp_path, fsdp_run, pipeline_run):
    clean = fsdp_run if strategy == "fsdp" else pipeline_run[0]
    run_dir = tmp_path / "run"
    train(run_dir, "--strategy", strategy, "--workers", "2", "--batch-size", "8", "--max-restarts", "1",
          "--fault", f"kill:rank={rank}:step=7")
    report = report_of(run_dir)
    assert report["restarts"] == 1 and report["recovery"]["events"][0]["resumed_from_step"] in (0, 4)
    recovered, expected = final_weights(run_dir), final_weights(clean)
    assert all(torch.equal(recovered[k], expected[k]) for k in expected), "the recovered run ended elsewhere"


@pytest.mark.parametrize(("flags", "message"), [
    (["--strategy", "pipeline", "--workers", "3"], "multiple of --stages 2"),
    (["--strategy", "pipeline", "--workers", "2", "--task-opt", "layers=1"], "only 1 block(s) to split"),
    (["--strategy", "tp", "--workers", "3"], "the 4 attention heads of layers.0.attention.wq over the ranks"),
    (["--strategy", "tp", "--workers", "2", "--fp16"], "cannot unscale tp's mix"),
    (["--strategy", "tp", "--workers", "2", "--clip-grad-norm", "1"], "not of --strategy tp (the others hold the "
     "gradients on several ranks without their global norm)"),
    (["--strategy", "pipeline", "--workers", "2", "--fault", "inf_grad:rank=0:step=2"], "runs its backward passes"),
    (["--strategy", "pipeline", "--workers", "2", "--batch-size", "6"], "microbatches=4: must divide --batch-size 6"),
    (["--strategy", "pipeline", "--workers", "2", "--microbatches", "1"], "1f1b needs at least one microbatch"),
    (["--strategy", "fsdp", "--workers", "2", "--optimizer-in-backward", "--clip-grad-norm", "1"],
     "--clip-grad-norm needs every gradient's norm before any update"),
    (["--strategy", "ddp", "--workers", "2", "--optimizer-in-backward"], "optimizer-in-backward"),
])
def test_a_pipeline_layout_that_cannot_work_is_refused_before_any_process_starts(flags, message, tmp_path):
    result = refused("train", *TASK, *flags, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_diverged_loss_is_reported_not_hidden(tmp_path):
    from mlscale import TrainConfig, fit

    # Losses are averaged over the ranks that compute one (a pipeline's last stages); a NaN still shows.
    report = fit(TrainConfig(task="digits", steps=20, lr=1e12, lr_schedule="constant", progress=False,
                             run_dir=str(tmp_path / "run")))
    assert report["final_loss"] != report["final_loss"]  # NaN
