"""Workers that start warm: forked by the job's zygote on every start and restart, the same run as a cold
start, and a client that stands in for its worker before the elastic agent (exit code, signals, death)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mlscale.rundir import RunDir
from mlscale.train.warm import FORK_ENV, WARM_ENV, zygote
from mlscale.train.warm_client import TOKEN_ENV
from tests.helpers import REPO, final_weights, run_cli

BASE = ["train", "--task", "digits", "--workers", "2", "--steps", "12", "--batch-size", "16", "--dtype", "float64",
        "--checkpoint-every", "4", "--collective-timeout", "20"]
CHILD = "tests.train.warm_child"


def starts(run_dir):
    return [json.loads(line) for line in RunDir(run_dir).warm_starts_path.read_text().splitlines()]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("warm") / "run"
    result = run_cli(*BASE, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


def test_two_workers_forked_by_the_zygote_end_with_the_cold_runs_weights(warm_run, tmp_path, monkeypatch):
    forked = starts(warm_run)
    assert sorted(s["rank"] for s in forked) == ["0", "1"] and {s["attempt"] for s in forked} == {"0"}
    assert len({s["zygote_pid"] for s in forked}) == 1
    monkeypatch.setenv(WARM_ENV, "0")
    cold = tmp_path / "cold"
    result = run_cli(*BASE, "--run-dir", str(cold))
    assert result.returncode == 0, result.stderr
    assert not RunDir(cold).warm_starts_path.exists()
    warm_weights, cold_weights = final_weights(warm_run), final_weights(cold)
    assert all(torch.equal(warm_weights[k], cold_weights[k]) for k in cold_weights)


def test_a_killed_worker_is_restarted_warm_by_the_same_zygote_and_the_job_finishes(warm_run, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*BASE, "--run-dir", str(run_dir), "--max-restarts", "1", "--fault", "kill:rank=1:step=7")
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["restarts"] == 1
    assert "worker rank 1 was killed at step 7" in result.stderr
    forked = starts(run_dir)
    assert sorted((s["attempt"], s["rank"]) for s in forked) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert len({s["zygote_pid"] for s in forked}) == 1
    weights, clean = final_weights(run_dir), final_weights(warm_run)
    assert all(torch.equal(weights[k], clean[k]) for k in clean)


@pytest.fixture(scope="module")
def zygote_env():
    """A zygote spawned fresh (as where the launcher may not fork) that runs the test's child module."""
    saved = {name: os.environ.get(name) for name in (FORK_ENV, "PYTHONPATH")}
    os.environ.update({FORK_ENV: "0", "PYTHONPATH": str(REPO)})
    try:
        with zygote(("mlscale.train", CHILD)) as env:
            yield {**os.environ, **env}
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def client(env, *args, python_flags=()):
    return subprocess.Popen([sys.executable, *python_flags, "-m", "mlscale.train.warm_client", CHILD, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_pid(proc):
    return int(proc.stdout.readline())


def gone(pid, within_s=10.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(("args", "code"), [(("exit", "3"), 3), (("exit", "0"), 0),
                                            (("signal", str(int(signal.SIGKILL))), -signal.SIGKILL),
                                            (("signal", str(int(signal.SIGTERM))), -signal.SIGTERM)])
def test_the_client_ends_as_its_worker_ended(zygote_env, args, code):
    proc = client(zygote_env, *args)
    pid = worker_pid(proc)
    assert proc.wait(timeout=30) == code
    assert pid != proc.pid  # forked by the zygote, not the client itself started cold
    assert "cold" not in proc.stderr.read()


def test_a_signal_to_the_client_reaches_the_worker(zygote_env):
    proc = client(zygote_env, "wait", "7")
    worker_pid(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7  # the worker's SIGTERM handler chose the code


def test_a_worker_dies_with_its_client(zygote_env):
    proc = client(zygote_env, "wait", "0")
    pid = worker_pid(proc)
    proc.kill()  # SIGKILL: the agent's last word, which the client cannot pass on
    proc.wait(timeout=30)
    assert gone(pid)


def test_the_client_imports_no_torch(zygote_env):
    proc = client(zygote_env, "exit", "0", python_flags=("-X", "importtime"))
    assert worker_pid(proc) != proc.pid and proc.wait(timeout=30) == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.read().splitlines()
                if line.startswith("import time:")]
    assert {"mlscale.train", "socket"} <= set(imported)  # the client's own imports are listed
    assert not [name for name in imported if name.split(".")[0] in ("torch", "numpy")]


def test_a_client_without_the_token_is_not_served(zygote_env):
    proc = client({**zygote_env, TOKEN_ENV: "not-the-token"}, "exit", "0")
    pid = worker_pid(proc)
    assert proc.wait(timeout=60) == 0
    assert pid == proc.pid  # refused: the client became the worker itself (exec), cold
    assert "mlscale: starting a worker cold (the zygote closed the connection)" in proc.stderr.read()
