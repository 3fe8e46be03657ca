"""The same worker entry point runs unchanged under an external torchrun."""

import json
import subprocess
import sys

from tests.helpers import REPO


def test_mlscale_train_runs_under_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "mlscale", "train", "--task", "digits", "--steps", "12", "--run-dir", str(run_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["world_size"] == 2 and report["steps"] == 12
    assert json.loads((run_dir / "config.json").read_text())["task"] == "digits"
