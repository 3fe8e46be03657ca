"""A registry with digits v1/v2 (ONNX-exported) and a slow synthetic model, and real server processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from mlscale import TrainConfig, fit
from mlscale.export import export_version
from mlscale.registry import Registry, register_run
from tests.helpers import REPO, free_port, shared_copy


def _build_serve_registry(root: Path) -> None:
    registry = Registry(str(root / "registry"))
    for seed in (0, 1):
        fit(TrainConfig(task="digits", steps=40, seed=seed, run_dir=str(root / f"digits{seed}")))
        version = register_run(registry, root / f"digits{seed}", "digits")
        export_version(registry, version.uri)
    registry.set_alias("digits", 1, "production")
    fit(TrainConfig(task="synthetic", task_options={"samples": 256, "width": 2048, "depth": 3}, steps=2,
                    run_dir=str(root / "slow")))
    register_run(registry, root / "slow", "slow")
    # a declared test task whose model sleeps on a row starting with SLOW and raises on one with FAIL
    fit(TrainConfig(task="tests.declared_tasks:misbehaving", task_options={"sleep_s": 2.0}, steps=2, batch_size=8,
                    run_dir=str(root / "misbehaving")))
    register_run(registry, root / "misbehaving", "misbehaving")


@pytest.fixture(scope="session")
def serve_registry(tmp_path_factory):
    """Trained and registered once per session; each pytest-xdist worker serves its own copy (tests move
    the production alias)."""
    return str(shared_copy(tmp_path_factory, "serve", _build_serve_registry) / "registry")


@contextmanager
def running_server(registry: str, *args: str, ready_timeout: float = 60, cpus: set[int] | None = None):
    """``mlscale serve ARGS`` in its own process on free ports (pinned to ``cpus`` if given); yields
    (base URL, process), with ``process.grpc_address`` where its gRPC service listens."""
    port = free_port()
    grpc = [] if "--no-grpc" in args or "--grpc-port" in args else ["--grpc-port", str(free_port())]
    process = subprocess.Popen([sys.executable, "-m", "mlscale", "serve", *args, "--port", str(port), *grpc,
                                "--registry", registry], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)},
                               preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + ready_timeout
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}: {process.stderr.read()}")
            try:
                if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise AssertionError("server did not become ready")
            time.sleep(0.1)
        process.grpc_address = f"127.0.0.1:{grpc[1]}" if grpc else None  # type: ignore[attr-defined]
        yield base, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def infer_body(rows: list[list[float]], name: str = "input", datatype: str = "FP32") -> dict:
    return {"inputs": [{"name": name, "shape": [len(rows), len(rows[0])], "datatype": datatype,
                        "data": [x for row in rows for x in row]}]}


def metric(base: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample from /metrics (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # exposition sorts labels
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}}") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
