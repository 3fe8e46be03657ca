"""Serving's core stands alone: the HTTP app and the gRPC service each build on ``serve/core.py`` and
never import each other, and a serving runtime is named once (``serve/runtimes.py``)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO, code_shape

SERVE = REPO / "mlscale" / "serve"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports count too), with
    ``from mlscale.serve import grpc`` counted as ``mlscale.serve.grpc``."""
    shape = code_shape()
    return {found.module for found in shape.imports(path, shape.module_files())}


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


def _serve_parser():
    import argparse

    from mlscale.cli import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    serve = commands.choices["serve"]
    serve.format_help()  # a LazyParser: its arguments are added on first use
    return {action.dest: action for action in serve._actions}


def test_every_list_of_runtimes_is_the_registry():
    import typing

    from mlscale.serve import describe
    from mlscale.serve.options import ServeOptions
    from mlscale.serve.runtimes import AUTO, RUNTIME_CHOICES, RUNTIMES

    kinds, choices = list(RUNTIMES), (AUTO, *RUNTIMES)
    assert kinds == ["onnx", "torch"] and choices == RUNTIME_CHOICES
    assert typing.get_args(ServeOptions.model_fields["runtime"].annotation) == choices  # the options Literal
    assert _serve_parser()["runtime"].choices == list(choices)  # mlscale serve --runtime
    assert list(describe.BACKENDS) == kinds
    assert all(describe.BACKENDS[kind] == (RUNTIMES[kind].platform, RUNTIMES[kind].backend) for kind in kinds)
    assert all(kind == runtime.kind for kind, runtime in RUNTIMES.items())


def test_each_runtime_is_named_as_its_code_and_its_artifact_as_the_registry_and_export_write_it():
    from mlscale.export.onnx import ONNX_ARTIFACT
    from mlscale.registry.store import WEIGHTS_ARTIFACT
    from mlscale.serve.runtime import OnnxRuntime, TorchRuntime
    from mlscale.serve.runtimes import RUNTIMES

    assert RUNTIMES[OnnxRuntime.kind].artifact == ONNX_ARTIFACT
    assert RUNTIMES[TorchRuntime.kind].artifact == WEIGHTS_ARTIFACT


def test_auto_picks_onnx_when_exported_else_torch_and_reduced_precision_only_runs_on_torch():
    import pytest

    from mlscale.errors import UsageError
    from mlscale.serve.runtimes import choose

    both = {"model.onnx", "model.safetensors"}
    assert choose("auto", both).kind == "onnx"
    assert choose("auto", {"model.safetensors"}).kind == "torch"
    assert choose("auto", both, "bf16").kind == "torch"
    assert choose("torch", both, "fp16").kind == "torch"
    with pytest.raises(UsageError, match="reduced-precision serving runs on the torch runtime"):
        choose("onnx", both, "fp16")
    with pytest.raises(UsageError, match="must be auto, onnx or torch"):
        choose("tensorrt", both)


def test_every_serve_option_is_a_flag_typed_from_its_annotation():
    from mlscale.cli.serve import _NOT_FLAGS
    from mlscale.serve.options import ServeOptions

    actions = _serve_parser()
    for name in ServeOptions.model_fields.keys() - _NOT_FLAGS:
        assert name in actions, name
    assert {"route_secret"} == _NOT_FLAGS and "route_secret" not in actions  # a secret is never a flag
    assert actions["expose_rollout_versions"].const is True  # a bool: a switch, off unless given
    assert actions["port"].type is int and actions["grpc_port"].type is int  # int | None: int
    assert actions["slo_ms"].type is float and actions["host"].type is str and actions["online_store"].type is str
    assert actions["precision"].choices == ["as-trained", "fp16", "bf16"] and actions["precision"].type is None
    assert actions["no_grpc"].const is True and "registry" in actions
