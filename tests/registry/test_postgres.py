"""The same registry on a real PostgreSQL server (each test in a schema of its own): versions, URIs,
concurrent registration with every artifact intact and no staging leftovers."""

import subprocess
import sys
import time

from mlscale.registry import Registry, register_run
from tests.helpers import REPO
from tests.registry.test_concurrency import WORKER


def test_register_promote_alias_and_resolve_on_postgres(postgres_url, tmp_path, trained_runs, monkeypatch):
    monkeypatch.setenv("MLSCALE_ARTIFACTS", str(tmp_path / "artifacts"))
    registry = Registry(postgres_url)
    assert register_run(registry, trained_runs["digits"], "pg-digits").version == 1
    assert register_run(registry, trained_runs["digits"], "pg-digits").version == 2
    registry.set_stage("pg-digits", 2, "Production", archive_existing=True)
    registry.set_alias("pg-digits", 1, "previous")
    assert registry.resolve("models:/pg-digits/Production").version == 2
    assert registry.resolve("models:/pg-digits@previous").version == 1
    assert [h["action"] for h in registry.history("pg-digits")][-2:] == ["stage", "alias:previous"]


def test_concurrent_registrations_on_postgres_keep_every_artifact_intact(postgres_url, tmp_path, trained_runs,
                                                                         monkeypatch):
    artifacts = tmp_path / "artifacts"
    monkeypatch.setenv("MLSCALE_ARTIFACTS", str(artifacts))
    Registry(postgres_url)  # this test's schema gets its tables once, as a team's first user would
    weights = trained_runs["digits"] / "final" / "model.safetensors"
    start, processes, count = time.time() + 3, 4, 5
    env = {"MLSCALE_ARTIFACTS": str(artifacts), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, postgres_url, str(weights), str(start), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
             for _ in range(processes)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    returned = sorted(int(line) for out, _ in outputs for line in out.split())
    assert returned == list(range(1, processes * count + 1))
    registry = Registry(postgres_url)
    versions = registry.versions("racy")
    assert [v.version for v in versions] == returned
    for version in versions:  # every version's artifact is in place and its SHA-256 verifies
        assert registry.artifact_path(version, "model.safetensors").read_bytes() == weights.read_bytes()
    assert sorted(p.name for p in (artifacts / "racy").iterdir()) == sorted(str(v) for v in returned)


def test_names_that_differ_only_by_case_racing_on_postgres_leave_one_model(postgres_url, tmp_path, trained_runs,
                                                                           monkeypatch):
    """Each registration locks only its own model's row; the unique index on the folded name makes the
    later one wait for the first and then refuses it, whatever the timing."""
    import threading

    from mlscale.errors import UsageError

    monkeypatch.setenv("MLSCALE_ARTIFACTS", str(tmp_path / "artifacts"))
    Registry(postgres_url)
    barrier, outcomes = threading.Barrier(2), {}

    def register(name):
        registry = Registry(postgres_url)
        barrier.wait()
        try:
            outcomes[name] = register_run(registry, trained_runs["digits"], name).uri
        except UsageError as exc:
            outcomes[name] = str(exc)
        finally:
            registry.engine.dispose()

    threads = [threading.Thread(target=register, args=(name,)) for name in ("CaseRace", "caserace")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    registry = Registry(postgres_url)
    assert [m["name"] for m in registry.list_models()] in (["CaseRace"], ["caserace"])
    winner = registry.list_models()[0]["name"]
    loser = "caserace" if winner == "CaseRace" else "CaseRace"
    assert outcomes[winner] == f"models:/{winner}/1" and f"model '{winner}' exists" in outcomes[loser]
    registry.artifact_path(registry.resolve(f"models:/{winner}/1"), "model.safetensors")  # verified, intact
