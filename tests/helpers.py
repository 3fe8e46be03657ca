"""Shared test helpers: run the real CLI in a subprocess, read a run's weights, tasks that fail; ports
and built-once folders that stay private to a test when the suite runs in parallel (pytest-xdist)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.util
import io
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file
from torch import nn

from mlscale.tasks import Task, declare_task, make_task

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def code_shape() -> ModuleType:
    """``bench/code_shape.py``: the one reader of mlscale's imports (and its import graph) that the
    layering tests share. A script, not a package module, so it is loaded by path."""
    spec = importlib.util.spec_from_file_location("code_shape", REPO / "bench" / "code_shape.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its own module while being made
    spec.loader.exec_module(module)
    return module


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None,
            plot: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m mlscale ARGS`` as a user runs it, in the test's own working directory (``cwd``); a hang
    fails the test after ``timeout``. ``train`` runs
    draw no plot unless ``plot`` (matplotlib's import and drawing cost ~1.5 s of CPU a run; tests/train/
    test_plot.py checks the picture)."""
    if args[:1] == ("train",) and not plot and "--no-plot" not in args:
        args = (*args, "--no-plot")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mlscale", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or Path.cwd(), env=env)


def refused(*args: str) -> subprocess.CompletedProcess[str]:
    """``mlscale ARGS``, for a command that must be refused before any process starts, run in this process:
    the same parsing and checks as ``run_cli`` without a fresh interpreter importing torch (3.5 s of CPU
    a call, four times that on the suite's busy cores). Should the command get past its checks instead,
    it is stopped before it prepares a run directory or starts a worker, and the test fails."""
    from mlscale import cli
    from mlscale.train import launcher

    def not_refused(*_args: object, **_kwargs: object) -> None:
        raise AssertionError(f"mlscale {' '.join(args)} was not refused: it went on to prepare the run")

    out, err, environ, prepare = io.StringIO(), io.StringIO(), dict(os.environ), launcher._prepare
    launcher._prepare = not_refused
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    except SystemExit as exc:  # argparse's own refusals, as ``mlscale`` (cli.run) exits with them
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        launcher._prepare = prepare
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["mlscale", *args], code, out.getvalue(), err.getvalue())


# Ports for the servers a test starts. Not the kernel's pick (bind to port 0): a port released by its
# probe and bound again by a server seconds later can be taken meanwhile as the source port of any
# outgoing connection (load generators open hundreds), or be picked by another test's probe. So each
# pytest process draws from its own block below the kernel's ephemeral range (32768 and up) and above
# the fixed ports the guides use (8000/8001, 8300/8301), and never hands out a port twice.
PORT_BLOCK, PORT_BASE, PORT_BLOCKS = 1000, 20000, 12
_handed_out: set[int] = set()


def _port_block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under xdist; unset otherwise
    index = int(worker[2:]) % (PORT_BLOCKS - 1) if worker.startswith("gw") else PORT_BLOCKS - 1
    return range(PORT_BASE + index * PORT_BLOCK, PORT_BASE + (index + 1) * PORT_BLOCK)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, from this process's own block."""
    block = [port for port in _port_block() if port not in _handed_out]
    for port in random.sample(block, len(block)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in {_port_block()}")


def shared_copy(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A private copy of a folder that ``build(folder)`` fills once per test session.

    Expensive fixtures (trained runs, a registry of them) are built by the first pytest-xdist worker
    that needs them, under a lock, in the session's folder above the workers' own; each worker then
    gets its own copy, so a test that moves an alias or rewrites a report touches nobody else's."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, shared by the workers (each has pytest-N/popen-gwK/)
    shared = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"shared-{name}.done").exists():
            shutil.rmtree(shared, ignore_errors=True)  # a build that failed half-way
            shared.mkdir()
            build(shared)
            (root / f"shared-{name}.done").touch()
    copy = tmp_path_factory.mktemp(name)
    shutil.copytree(shared, copy, dirs_exist_ok=True)
    return copy


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class _Exploding(nn.Module):
    """Wraps a model and raises on one rank at one step, as a user's bug would."""

    def __init__(self, inner: nn.Module, rank: int, step: int) -> None:
        super().__init__()
        self.inner, self.rank, self.step, self.calls = inner, rank, step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ.get("RANK", 0)) == self.rank and self.calls == self.step:
            raise RuntimeError(f"boom on rank {self.rank} at step {self.step}")
        return self.inner(x)


@declare_task
def exploding_task(rank: int = 1, step: int = 3) -> Task:
    task = make_task("digits")
    inner = task.build_model
    task.build_model = lambda: _Exploding(inner(), rank, step)
    return task


def _build_user_models_registry(root: Path) -> None:
    from mlscale import TrainConfig, fit
    from mlscale.export import export_version
    from mlscale.registry import Registry, register_run

    registry = Registry(str(root / "registry"))
    for name in ("gpt2", "cnn"):
        fit(TrainConfig(task=f"tests.user_models:{name}", steps=2, batch_size=8, run_dir=str(root / name)))
        export_version(registry, register_run(registry, root / name, name).uri)


def user_models_registry(tmp_path_factory) -> Path:
    """A registry folder holding models:/gpt2/1 (its head tied to its embedding, returning a ModelOutput)
    and models:/cnn/1 (a dict output, buffers), each trained 2 steps and exported to ONNX; built once per
    session, a private copy for each caller. The runs are beside it (``../gpt2``, ``../cnn``)."""
    return shared_copy(tmp_path_factory, "user-models", _build_user_models_registry) / "registry"
