"""``--log-sample-ids``: the sharding contract read back from what the ranks trained. A worker killed
mid-epoch, the run resumed on another number of workers (and of data workers): every index of the epoch
trained exactly once, counting for each step its latest attempt."""

from __future__ import annotations

import json
from pathlib import Path

from mlscale.rundir import RunDir
from mlscale.train.sample_ids import trained_once
from tests.helpers import refused, run_cli

SAMPLES = 160  # 4 steps of 2 x 8, then 4 of 3 x 8: the epoch exactly, nothing left over
COMMON = ["--task", "synthetic", "--task-opt", f"samples={SAMPLES}", "--batch-size", "8", "--checkpoint-every", "4",
          "--no-async-checkpoint", "--steps", "8", "--log-sample-ids", "--no-progress"]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(RunDir(run_dir).sample_ids.glob("rank*.jsonl"))
            for line in path.read_text().splitlines()]


def test_killed_mid_epoch_and_resumed_on_three_workers_every_sample_is_trained_once(tmp_path):
    run_dir = tmp_path / "run"
    killed = run_cli("train", *COMMON, "--run-dir", str(run_dir), "--workers", "2", "--fault", "kill:rank=1:step=6")
    assert killed.returncode == 1, killed.stderr[-2000:]
    resumed = run_cli("train", *COMMON, "--run-dir", str(run_dir), "--workers", "3", "--data-workers", "1", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = _lines(run_dir)
    assert {line["attempt"] for line in lines if line["step"] <= 4} == {0}  # before the checkpoint: trained once
    redone = {line["step"] for line in lines if line["attempt"] == 0} & {line["step"] for line in lines
                                                                         if line["attempt"] == 1}
    assert redone and min(redone) == 5  # trained after the checkpoint, then again after the resume
    counted = trained_once(lines)
    assert sorted(counted) == list(range(1, 9))
    ids = [i for step in counted.values() for i in step]
    assert sorted(ids) == list(range(SAMPLES))  # every index of the epoch, exactly once
    assert {len(counted[s]) for s in range(1, 5)} == {16} and {len(counted[s]) for s in range(5, 9)} == {24}
    files = sorted(path.name for path in RunDir(run_dir).sample_ids.glob("rank*.jsonl"))
    assert files == [f"rank{r}.jsonl" for r in range(3)]


def test_the_latest_attempt_of_a_step_counts():
    lines = [{"step": 1, "attempt": 0, "ids": [0, 1]}, {"step": 2, "attempt": 0, "ids": [2, 3]},
             {"step": 2, "attempt": 1, "ids": [4, 5]}, {"step": 3, "attempt": 1, "ids": [2, 3]}]
    assert trained_once(lines) == {1: [0, 1], 2: [4, 5], 3: [2, 3]}


def test_sample_ids_under_a_strategy_that_does_not_log_them_yet_is_one_line():
    result = refused("train", "--task", "digits", "--strategy", "ps", "--workers", "2", "--log-sample-ids")
    assert result.returncode == 2 and "log-sample-ids" in result.stderr and len(result.stderr.splitlines()) == 1
