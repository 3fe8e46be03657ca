"""Killed, hung and checkpoint-crashing workers are recovered automatically and the run stays the same run.

Every scenario runs 2 real worker processes through the elastic launcher and compares the final weights
bitwise with the same run without the fault.
"""

import json
import shutil

import pytest
import torch

from tests.helpers import final_weights, run_cli

STEPS, EVERY = 24, 5
BASE = ["train", "--task", "digits", "--workers", "2", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
        "--batch-size", "16", "--collective-timeout", "5"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    result = run_cli(*BASE, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return final_weights(run_dir)


def run_with(tmp_path, *extra, timeout=120):
    run_dir = tmp_path / "run"
    result = run_cli(*BASE, "--run-dir", str(run_dir), *extra, timeout=timeout)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    return run_dir, result, report


def assert_same_run(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "the recovered run ended with other weights"


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(rank, tmp_path, clean_run):
    run_dir, result, report = run_with(tmp_path, "--max-restarts", "1", "--fault", f"kill:rank={rank}:step=13")
    assert result.returncode == 0, result.stderr
    assert report["status"] == "completed" and report["restarts"] == 1
    assert_same_run(final_weights(run_dir), clean_run)
    [event] = report["recovery"]["events"]
    # A sharded checkpoint is complete once every rank has written its part: the one of step 10 may
    # still have been in flight (about 20 ms here) when a rank died two steps later.
    assert event["failed_at_step"] == 12 and event["resumed_from_step"] in (5, 10)
    assert event["steps_redone"] == 12 - event["resumed_from_step"]
    assert 0 < event["downtime_s"] < 60
    # the console says it too, as it happens: who, how, at which step; the restart; where it resumed
    assert (f"mlscale: worker rank {rank} was killed at step 13 (SIGKILL, injected by --fault); restarted the "
            f"worker group (restart 1 of 1), resuming from the checkpoint of step {event['resumed_from_step']}"
            ) in result.stderr
    assert (f"mlscale: resumed from step {event['resumed_from_step']} after {event['downtime_s']:.1f} s, "
            f"{event['steps_redone']} steps redone") in result.stderr


def test_a_hung_worker_is_detected_by_the_collective_timeout_and_restarted(tmp_path, clean_run):
    run_dir, result, report = run_with(tmp_path, "--max-restarts", "1", "--fault", "hang:rank=1:step=8")
    assert result.returncode == 0, result.stderr
    assert report["restarts"] == 1
    assert_same_run(final_weights(run_dir), clean_run)
    assert report["recovery"]["events"][0]["downtime_s"] >= 5  # the timeout is part of the downtime
    assert "mlscale: worker rank 1 stopped responding at step 8" in result.stderr
    assert "restarted the worker group (restart 1 of 1), resuming from the checkpoint of step 5" in result.stderr
    assert "mlscale: resumed from step 5 after" in result.stderr and ", 2 steps redone" in result.stderr


def test_a_worker_that_raises_is_named_with_its_error_and_step_on_the_console(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "tests.helpers:exploding_task", "--workers", "2", "--steps", "10",
                     "--checkpoint-every", "2", "--max-restarts", "1", "--run-dir", str(run_dir))
    assert result.returncode == 1  # it raises again after the restart: out of restarts
    assert ("mlscale: worker rank 1 failed at step 3: RuntimeError: boom on rank 1 at step 3; restarted the worker "
            "group (restart 1 of 1), resuming from the checkpoint of step 2") in result.stderr
    assert "mlscale: resumed from step 2 after" in result.stderr


def test_out_of_restarts_a_hang_fails_naming_the_rank_and_how_to_resume(tmp_path):
    run_dir, result, report = run_with(tmp_path, "--fault", "hang:rank=1:step=8")
    assert result.returncode == 1
    assert "worker rank 1 stopped responding" in result.stderr and "5 s" in result.stderr
    assert "last good checkpoint:" in result.stderr and "step_00000005" in result.stderr
    assert f"mlscale train --run-dir {run_dir} --resume" in result.stderr
    assert "Traceback" not in result.stderr
    assert report["status"] == "failed" and report["error"]["rank"] == 1


def test_out_of_restarts_a_kill_fails_with_one_paragraph_and_the_resume_command_works(tmp_path, clean_run):
    # Blocking checkpoints: the one of step 5 is complete before step 6 starts (an async one might still
    # be in flight when the rank dies, and the message would then name none).
    run_dir, result, _ = run_with(tmp_path, "--fault", "kill:rank=1:step=7", "--no-async-checkpoint")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "mlscale: training failed: worker rank 1 was killed by SIGKILL."
    assert "restarts used: 0 of 0" in result.stderr
    assert "step_00000005" in result.stderr and "Traceback" not in result.stderr
    resumed = run_cli("train", "--run-dir", str(run_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(final_weights(run_dir), clean_run)


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_and_the_run_recovers(tmp_path, clean_run):
    run_dir, result, report = run_with(tmp_path, "--max-restarts", "1", "--fault", "kill_during_checkpoint:step=15")
    assert result.returncode == 0, result.stderr
    [event] = report["recovery"]["events"]
    assert event["resumed_from_step"] == 10
    assert_same_run(final_weights(run_dir), clean_run)


def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, clean_run):
    run_dir, result, _ = run_with(tmp_path, "--keep-checkpoints", "10")
    assert result.returncode == 0
    for name in ("step_00000024", "step_00000020"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    (run_dir / "report.json").unlink()
    newest = run_dir / "checkpoints" / "step_00000015" / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a disk fault
    result = run_cli(*BASE, "--run-dir", str(run_dir), "--resume")
    assert result.returncode == 0, result.stderr
    assert "skipping damaged checkpoint" in result.stderr
    assert json.loads((run_dir / "report.json").read_text())["resumed_from_step"] == 10
    assert_same_run(final_weights(run_dir), clean_run)
