"""The features guide runs as written: its marked blocks, in order, in a fresh folder, as the README's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.test_readme import readme_script


@pytest.mark.timeout(400)
def test_the_features_guide_runs_from_definition_to_the_skew_alarm(tmp_path):
    script = readme_script((REPO / "docs" / "features.md").read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MLSCALE_REGISTRY": str(tmp_path / "registry")}
    env.pop("PYTHONPATH", None)
    shell = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = shell.communicate(timeout=360)
    finally:  # no server of the guide outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert shell.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert "'spend_per_order'" in stdout  # the training set's columns
    assert '"model_name":"churn"' in stdout and '"feature_vectors"' in stdout
    assert 'mlscale_feature_skew{feature="spend"' in stdout or 'feature="spend"' in stdout
    assert "SKEWED" in stdout and "skew gate: exit 1" in stdout
