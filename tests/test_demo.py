"""`make demo` end to end in a fresh folder: trains, registers, exports, serves, and reports a goodput
measured on distinct inputs with the cache off, the cache apart, and a new run folder every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.timeout(600)
def test_the_demo_reports_goodput_on_distinct_uncached_inputs_and_keeps_each_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLSCALE_REGISTRY", None)
    runs = []
    for _ in range(2):
        # --quick: the same steps as `make demo`, shorter (what this test checks is the steps and the files)
        result = subprocess.run([sys.executable, "-m", "mlscale.demo", "--quick"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=500)
        assert result.returncode == 0, result.stderr[-2000:]
        runs.append(result.stdout)
    summary = runs[-1]
    assert "distinct inputs, cache off" in summary and "missed the SLO" in summary
    assert "cache hits (separate)" in summary
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2  # each demo in a new folder: version 1's source run still holds version 1
    serving = json.loads((folders[-1] / "serving.json").read_text())
    assert any(not t["meets_slo"] for t in serving["trials"])  # searched until a trial missed the SLO
    assert serving["inputs"].startswith("distinct")
    shown = subprocess.run([sys.executable, "-m", "mlscale", "models", "show", "digits-demo"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert shown.stdout.count("(verified)") == 2, shown.stdout
