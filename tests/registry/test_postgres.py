"""The same registry on a real PostgreSQL server: versions, URIs, concurrent registration."""

import subprocess
import sys
import time

import pytest

from mlscale.registry import Registry, register_run
from tests.helpers import REPO
from tests.registry import postgres
from tests.registry.test_concurrency import WORKER

pytestmark = pytest.mark.skipif(not postgres.available(), reason="PostgreSQL server binaries are not installed")


@pytest.fixture(scope="module")
def pg_url():
    with postgres.temporary_server() as url:
        yield url


def test_register_promote_alias_and_resolve_on_postgres(pg_url, tmp_path, trained_runs, monkeypatch):
    monkeypatch.setenv("MLSCALE_ARTIFACTS", str(tmp_path / "artifacts"))
    registry = Registry(pg_url)
    assert register_run(registry, trained_runs["digits"], "pg-digits").version == 1
    assert register_run(registry, trained_runs["digits"], "pg-digits").version == 2
    registry.set_stage("pg-digits", 2, "Production", archive_existing=True)
    registry.set_alias("pg-digits", 1, "previous")
    assert registry.resolve("models:/pg-digits/Production").version == 2
    assert registry.resolve("models:/pg-digits@previous").version == 1
    assert [h["action"] for h in registry.history("pg-digits")][-2:] == ["stage", "alias:previous"]


def test_concurrent_registrations_on_postgres(pg_url, tmp_path, trained_runs):
    env_artifacts = str(tmp_path / "artifacts")
    weights = trained_runs["digits"] / "final" / "model.safetensors"
    start, processes, count = time.time() + 3, 4, 5
    env = {"MLSCALE_ARTIFACTS": env_artifacts, "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, pg_url, str(weights), str(start), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
             for _ in range(processes)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    returned = sorted(int(line) for out, _ in outputs for line in out.split())
    assert returned == list(range(1, processes * count + 1))
