"""The rendered training Job, run locally: its pods' exact commands as local "pods" (tests/deploy/pods.py).

It trains what ``mlscale train --workers N`` trains with the same config, and when one pod is killed
mid-run (every process in it, as when its node is lost), the retry the Job makes resumes from the
shared checkpoint and ends with the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mlscale.deploy import render_training_job, training_manifests
from tests.deploy.pods import by_kind, job_pods, require_namespaces
from tests.helpers import REPO, final_weights, max_abs_diff

NODES = 2
# float64, so that "the same training" can be checked to 1e-10; a fixed compute time per step gives a
# window in which to kill a pod between two checkpoints.
CONFIG = """task = "digits"
dtype = "float64"
steps = 30
checkpoint_every = 10
max_restarts = 2
simulated_compute_ms = 100
log_every = 10
"""
POD_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("job") / "run.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def reference(config_file, tmp_path_factory) -> dict[str, torch.Tensor]:
    """``mlscale train --config run.toml --workers 2`` on this machine: what the Job must equal."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = subprocess.run([sys.executable, "-m", "mlscale", "train", "--config", str(config_file), "--workers",
                             str(NODES), "--run-dir", str(run_dir), "--no-progress", "--no-plot"],
                            capture_output=True, text=True, timeout=POD_TIMEOUT_S, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return final_weights(run_dir)


def _render(config_file: Path) -> list[dict]:
    job, _ = render_training_job(config_path=str(config_file), nodes=NODES, image="mlscale:test",
                                 name="digits-job", checkpoint_claim="runs")
    return training_manifests(job)


def _start(*pods) -> None:
    """What the kubelet does with each pod: the check init container to its end, then the trainer."""
    checks = [pod.start("check") for pod in pods]
    for pod, check in zip(pods, checks):
        assert check.wait(timeout=POD_TIMEOUT_S) == 0, pod.log.read_text()
    for pod in pods:
        pod.start("trainer")


def _wait_for_checkpoint(folder: Path, step: int, pods, timeout: float = POD_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while not (folder.exists() and any(folder.glob(f"step_*{step}"))):
        assert all(p.process.poll() is None for p in pods), "a pod ended before the checkpoint"
        assert time.time() < deadline, f"no checkpoint of step {step} in {folder}"
        time.sleep(0.05)


@pytest.fixture
def workdir(tmp_path):
    require_namespaces()
    claims = {"runs": tmp_path / "claim-runs"}
    claims["runs"].mkdir()
    yield tmp_path, claims


def _finish(pods) -> None:
    try:
        codes = [p.process.wait(timeout=POD_TIMEOUT_S) for p in pods]
        assert codes == [0] * len(pods), "\n".join(p.log.read_text()[-3000:] for p in pods)
    finally:
        for pod in pods:
            pod.kill()


def test_the_rendered_job_trains_what_mlscale_train_workers_n_trains(config_file, reference, workdir):
    """Also: pod 0 is rank 0, whatever the order the pods come in. The success policy waits for index 0,
    so index 0 must be the rank that writes the report: the rendezvous orders nodes by name, and
    '<job>-0.' sorts before '<job>-1', '<job>-10', ... Rank 0 prints the summary: in pod 0's log only."""
    root, claims = workdir
    manifests = _render(config_file)
    job = by_kind(manifests, "Job")
    assert job["spec"]["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    pods = job_pods(manifests, root, claims)
    _start(*reversed(pods))  # pod 1 first
    _finish(pods)
    logs = [pod.log.read_text() for pod in pods]
    assert "final loss" in logs[0] and all("final loss" not in log for log in logs[1:])
    name = job["metadata"]["name"]
    names = [f"{name}-{i}.{name}.default.svc.cluster.local" for i in range(12)]
    assert sorted(names)[0] == names[0]  # and so for any number of pods
    run_dir = claims["runs"] / by_kind(manifests, "Job")["metadata"]["name"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["world_size"] == NODES and report["restarts"] == 0
    difference = max_abs_diff(final_weights(run_dir), reference)
    print(f"job of {NODES} pods: max |weights - mlscale train --workers {NODES}| = {difference:.3g}")
    assert difference <= 1e-10


def test_a_killed_pod_is_retried_and_the_job_resumes_with_the_same_weights(config_file, reference, workdir):
    root, claims = workdir
    manifests = _render(config_file)
    pods = job_pods(manifests, root, claims)
    run_dir = claims["runs"] / by_kind(manifests, "Job")["metadata"]["name"]
    _start(*pods)
    try:
        _wait_for_checkpoint(run_dir / "checkpoints", 10, pods)
        pods[1].kill()  # its node is lost: the agent and the worker die together
        assert pods[1].process.returncode != 0  # a failed pod: the Job retries its index (backoffLimitPerIndex)
        _start(pods[1])  # the retry: the same command, the same index and name
    except BaseException:
        for pod in pods:
            pod.kill()
        raise
    _finish(pods)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["steps"] == 30
    assert report["restarts"] >= 1 and report["resumed_from_step"] >= 10
    events = [json.loads(line) for line in (run_dir / "recovery.jsonl").read_text().splitlines()]
    assert events and events[-1]["resumed_from_step"] >= 10
    difference = max_abs_diff(final_weights(run_dir), reference)
    print(f"pod killed: {events[-1]}; max |weights - mlscale train --workers 2| = {difference:.3g}")
    assert difference <= 1e-10


def test_a_config_error_fails_in_the_check_container_with_exit_2(tmp_path, workdir):
    """What the Job's podFailurePolicy turns into a failed Job at once (exit 2 of the check container)."""
    root, claims = workdir
    config = tmp_path / "bad.toml"
    config.write_text('task = "digits"\nbatch_size = 100000\n')
    manifests = _render(config)
    job = by_kind(manifests, "Job")
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"] == {"containerName": "check", "operator": "In",
                                                                 "values": [2]}
    pod = job_pods(manifests, root, claims)[0]
    assert pod.run("check", timeout=60) == 2
    last = pod.log.read_text().strip().splitlines()[-1]
    assert last.startswith("mlscale: error: bad value batch-size=100000")
