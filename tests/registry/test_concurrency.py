"""Processes registering at the same moment never lose or duplicate a version (real processes, one
SQLite file)."""

import subprocess
import sys
import time

from mlscale.registry import Registry
from tests.helpers import REPO

WORKER = """
import sys, time
from pathlib import Path
from mlscale.registry import Registry
registry_dir, weights, start, count = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
registry = Registry(registry_dir)
time.sleep(max(0.0, start - time.time()))  # all processes start registering at the same moment
for i in range(count):
    v = registry.create_version("racy", {"model.safetensors": weights}, config={"i": i}, metrics={}, signature={})
    print(v.version, flush=True)
"""


def test_concurrent_registrations_get_distinct_consecutive_versions(tmp_path, trained_runs):
    registry_dir = str(tmp_path / "registry")
    Registry(registry_dir)  # create the schema once, as a team's first user would
    weights = trained_runs["digits"] / "final" / "model.safetensors"
    start, processes, count = time.time() + 3, 4, 5
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, registry_dir, str(weights), str(start), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(processes)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    returned = sorted(int(line) for out, _ in outputs for line in out.split())
    assert returned == list(range(1, processes * count + 1))
    registry = Registry(registry_dir)
    versions = registry.versions("racy")
    assert [v.version for v in versions] == returned
    for version in versions:  # every version's artifact is in place and intact
        registry.artifact_path(version, "model.safetensors")
    leftovers = [p.name for p in (registry.artifacts.root / "racy").iterdir() if p.name.startswith(".staging")]
    assert leftovers == []
