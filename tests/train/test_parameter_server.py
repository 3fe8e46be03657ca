"""The parameter server: bsp is ddp exactly, ssp keeps its bound, async and backup workers never wait
for a straggler, and a killed worker or server is recovered from a checkpoint."""

import json
from pathlib import Path

import pytest

from tests.helpers import final_weights, max_abs_diff, refused, run_cli

STEPS, BATCH = 24, 16


def train(run_dir, *args: str, timeout: float = 180) -> dict:
    result = run_cli("train", "--task", "digits", "--batch-size", str(BATCH), "--run-dir", str(run_dir),
                     "--collective-timeout", "60", "--json", "--no-plot", *args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    train(run_dir, "--workers", "2", "--steps", str(STEPS), "--dtype", "float64")
    return run_dir


def test_bsp_with_two_servers_ends_with_the_weights_of_ddp(tmp_path, ddp_reference):
    run_dir = tmp_path / "run"
    report = train(run_dir, "--strategy", "ps", "--ps-servers", "2", "--workers", "2", "--steps", str(STEPS),
                   "--dtype", "float64")
    diff = max_abs_diff(final_weights(run_dir), final_weights(ddp_reference))
    assert diff <= 1e-10, f"ps bsp differs from ddp by {diff:.3e}"
    server = report["parameter_server"]
    assert report["world_size"] == 4 and report["workers"] == 2
    assert len(server["shard_numel"]) == 2 and min(server["shard_numel"]) > 0  # both servers hold a shard
    assert server["gradients_applied"] == 2 * STEPS and server["gradients_dropped"] == 0


# Straggler detection measures wall time: the simulated compute of every rank (COMPUTE_MS) must dwarf
# what a loaded host adds to a rank's median step (a rank is flagged at 1.5x the fastest), and a slow
# fault must dwarf it in turn; a millisecond of real compute on digits would be all noise.
COMPUTE_MS = "20"


@pytest.fixture(scope="module")
def straggling(tmp_path_factory):
    """ssp (bound 1) and async, 3 workers, worker rank 2 slower by 60 ms a step than the others' 20 ms."""
    runs = {}
    for sync in ("ssp", "async"):
        run_dir = tmp_path_factory.mktemp(sync) / "run"
        runs[sync] = train(run_dir, "--strategy", "ps", "--sync", sync, "--staleness", "1", "--workers", "3",
                           "--steps", "30", "--simulated-compute-ms", COMPUTE_MS,
                           "--fault", "slow:rank=2:delay_ms=60", "--log-every", "5")
    return runs


def test_ssp_never_applies_a_gradient_more_than_the_bound_stale(straggling):
    server = straggling["ssp"]["parameter_server"]
    histogram = {int(k): n for k, n in server["staleness"]["histogram"].items()}
    assert sum(histogram.values()) == server["gradients_applied"] == 3 * 30  # every applied gradient counted
    assert max(histogram) == 1, histogram  # the bound is reached (fast workers run ahead) and never passed


def test_async_applies_gradients_as_they_arrive_so_fast_workers_do_more(straggling):
    server = straggling["async"]["parameter_server"]
    assert server["gradients_applied"] == 3 * 30
    assert server["staleness"]["max"] > 1  # nobody waited for the straggler: the others ran far ahead
    assert server["version_lag"]["max"] > 1  # and its gradients were applied several steps late
    applied = server["applied_by_worker"]
    assert applied["2"] < min(applied["1"], applied["3"]), applied  # the straggler did the least work


def test_backup_workers_apply_a_step_without_waiting_for_the_late_gradient(tmp_path):
    delay_ms = 150
    report = train(tmp_path / "run", "--strategy", "ps", "--backup-workers", "1", "--workers", "3",
                   "--steps", "30", "--simulated-compute-ms", "10", "--fault", f"slow:rank=2:delay_ms={delay_ms}")
    server = report["parameter_server"]
    assert server["gradients_applied"] == 2 * 30
    assert server["gradients_dropped"] >= 1 and server["samples_dropped"] == server["gradients_dropped"] * BATCH
    # the slow worker's gradient is almost never among the first two (only while the others start up, or
    # when a busy host stalls them past its delay): without backup workers it would be in all 30
    assert server["applied_by_worker"].get("2", 0) <= 6, server["applied_by_worker"]
    assert server["step_ms_p50"] < delay_ms / 4, server["step_ms_p50"]  # no step waited for it


def test_a_slow_ddp_rank_is_flagged_within_20_steps_and_only_it(tmp_path):
    run_dir = tmp_path / "run"
    report = train(run_dir, "--workers", "3", "--steps", "30", "--log-every", "5", "--simulated-compute-ms",
                   COMPUTE_MS, "--fault", "slow:rank=1:delay_ms=40")
    first = next(line["step"] for line in metrics(run_dir) if 1 in line["stragglers"])
    assert first <= 20
    assert report["stragglers"] == [1]
    assert report["straggler_detection"]["flagged"]["1"]["max_score"] >= 1.5
    assert all("straggler_score" in row for row in metrics(run_dir)[-1]["per_rank"])


@pytest.mark.parametrize("sync", ["ssp", "async"])
def test_a_slow_parameter_server_worker_is_flagged_within_20_steps_and_only_it(sync, straggling):
    report = straggling[sync]
    first = next(line["step"] for line in metrics(Path(report["run_dir"])) if 2 in line["stragglers"])
    assert first <= 20
    assert report["stragglers"] == [2]


def test_no_ddp_rank_is_flagged_when_no_fault_is_injected(tmp_path):
    run_dir = tmp_path / "run"
    report = train(run_dir, "--workers", "3", "--steps", "40", "--log-every", "5", "--simulated-compute-ms",
                   COMPUTE_MS)
    assert report["stragglers"] == []
    assert all(line["stragglers"] == [] for line in metrics(run_dir))


@pytest.mark.parametrize("killed", [2, 0], ids=["worker", "server"])
def test_a_killed_parameter_server_rank_is_recovered_from_the_checkpoint(killed, tmp_path, ddp_reference):
    run_dir = tmp_path / "run"
    report = train(run_dir, "--strategy", "ps", "--workers", "2", "--steps", str(STEPS), "--dtype", "float64",
                   "--checkpoint-every", "5", "--max-restarts", "1", "--fault", f"kill:rank={killed}:step=13")
    # the newest durable checkpoint: step 10, or step 5 when the background write of step 10 was still
    # in flight (a server's steps on digits take a millisecond or two) when the kill came
    assert report["restarts"] == 1 and report["resumed_from_step"] in (5, 10)
    fired = [json.loads(line) for line in (run_dir / "logs" / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["rank"]) for f in fired] == [("kill", killed)]
    # nothing lost, nothing applied twice: the same weights as ddp without a failure
    diff = max_abs_diff(final_weights(run_dir), final_weights(ddp_reference))
    assert diff <= 1e-10, f"the recovered run differs from the uninterrupted one by {diff:.3e}"
    assert report["parameter_server"]["gradients_applied"] == 2 * STEPS


@pytest.mark.parametrize(("args", "message"), [
    (["--sync", "async", "--backup-workers", "1"], "backup workers need --sync bsp"),
    (["--backup-workers", "2"], "must be fewer than the 2 worker(s)"),
    (["--precision", "fp16"], "does not scale losses"),
    (["--sync", "sometimes"], "sync"),
])
def test_parameter_server_options_it_cannot_honour_are_one_line_and_exit_2(args, message, tmp_path):
    result = refused("train", "--strategy", "ps", "--workers", "2", "--steps", "2", "--run-dir",
                     str(tmp_path / "run"), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
