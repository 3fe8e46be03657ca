"""The run directory holds exactly what docs/architecture.md promises, with measured per-rank timings."""

import json

import pytest

from tests.helpers import final_weights, run_cli

REPORT_KEYS = {"status", "task", "strategy", "world_size", "steps", "samples_seen", "samples_per_s", "final_loss",
               "eval", "restarts", "per_rank", "stragglers", "wall_s", "model_uri"}
RANK_KEYS = {"rank", "step_ms_p50", "compute_ms_p50", "comm_ms_p50", "data_wait_ms_p50", "optimizer_ms_p50"}


@pytest.fixture(scope="module")
def two_worker_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rundir") / "run"
    result = run_cli("train", "--task", "digits", "--workers", "2", "--steps", "30", "--log-every", "10",
                     "--run-dir", str(run_dir), timeout=180)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_report_has_every_contract_key_and_measured_timings(two_worker_run):
    run_dir, _ = two_worker_run
    report = json.loads((run_dir / "report.json").read_text())
    assert report.keys() >= REPORT_KEYS | {"memory", "mixed_precision", "communication"}
    assert report["status"] == "completed" and report["world_size"] == 2 and report["steps"] == 30
    assert report["samples_seen"] == 30 * 2 * 32 and report["samples_per_s"] > 0
    assert 0 <= report["eval"]["accuracy"] <= 1 and report["restarts"] == 0 and report["model_uri"] is None
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    for row in report["per_rank"]:
        assert row.keys() >= RANK_KEYS
        assert row["step_ms_p50"] > 0 and row["compute_ms_p50"] > 0 and row["comm_ms_p50"] > 0
        assert row["data_wait_ms_p50"] < row["step_ms_p50"] and 0 < row["optimizer_ms_p50"] < row["step_ms_p50"]


def test_config_metrics_and_final_weights(two_worker_run):
    run_dir, _ = two_worker_run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["workers"] == 2 and config["steps"] == 30 and config["task"] == "digits"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20, 30]
    assert all(len(line["per_rank"]) == 2 and line["loss"] > 0 for line in lines)
    weights = final_weights(run_dir)
    assert weights and not any(name.startswith("module.") for name in weights)


def test_progress_is_plain_lines_when_output_is_not_a_terminal(two_worker_run):
    _, result = two_worker_run
    assert "step 30/30" in result.stderr and "samples/s" in result.stderr and "\r" not in result.stderr
    assert "accuracy" in result.stdout
