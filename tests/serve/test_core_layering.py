"""Serving's core stands alone: the HTTP app and the gRPC service each build on ``serve/core.py`` and
never import each other, and a serving runtime is named once (``serve/runtimes.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

SERVE = REPO / "mlscale" / "serve"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports count too), with
    ``from mlscale.serve import grpc`` counted as ``mlscale.serve.grpc``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _imports_module(path: Path, module: str) -> bool:
    return any(name == module or name.startswith(f"{module}.") for name in _imports(path))


def test_the_http_app_and_the_grpc_service_do_not_import_each_other():
    assert not _imports_module(SERVE / "http.py", "mlscale.serve.grpc")
    assert not _imports_module(SERVE / "grpc.py", "mlscale.serve.http")
    for transport in ("http.py", "grpc.py"):  # both stand on the core
        assert _imports_module(SERVE / transport, "mlscale.serve.core"), transport


def test_the_core_imports_no_transport():
    for module in ("mlscale.serve.http", "mlscale.serve.grpc", "mlscale.serve.server", "starlette", "grpc",
                   "uvicorn"):
        assert not _imports_module(SERVE / "core.py", module), module


def test_the_grpc_service_module_imports_grpcio_not_itself():
    import grpc

    import mlscale.serve.grpc as service

    assert service.grpc is grpc and service is not grpc and hasattr(service.grpc, "aio")
