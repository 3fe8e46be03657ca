"""The layering is visible and kept: lower parts never import higher ones, no module is in an import
circle, and the command tree is built without importing what only one sub-command needs."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, code_shape


def _modules_after(code: str) -> set[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_mlscale_help_imports_no_benchmark_no_server_and_no_torch():
    loaded = _modules_after("from mlscale.cli import build_parser\nbuild_parser().format_help()")
    heavy = {m for m in loaded if m.startswith(("mlscale.bench", "mlscale.serve", "torch", "numpy", "pydantic"))}
    assert heavy == set()


def test_a_benchmark_help_imports_that_benchmark_only():
    code = ("from mlscale.cli import build_parser\nimport contextlib, io\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    build_parser().parse_args(['bench', 'export', '--help'])")
    loaded = _modules_after(code)
    assert "mlscale.bench.export" in loaded
    assert not {"mlscale.bench.serve", "mlscale.bench.train", "mlscale.bench.checkpoint"} & loaded


PACKAGE = REPO / "mlscale"


def _parts() -> set[str]:
    """Every part of the package: a folder with an ``__init__.py`` or a single module (``config.py``)."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return folders | modules


def _files(part: str) -> list[Path]:
    """A part's source files: ``mlscale/PART.py`` and everything under ``mlscale/PART/`` (either, or both
    while a module grows into a folder)."""
    single = PACKAGE / f"{part}.py"
    return sorted(([single] if single.is_file() else []) + list((PACKAGE / part).rglob("*.py")))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top, inside a function or for type checking only; relative
    imports resolved, and a name a package imports on first use counted as the module it comes from."""
    shape = code_shape()
    return {found.module for found in shape.imports(path, shape.module_files())}


def _under(name: str, modules: tuple[str, ...]) -> bool:
    """``name`` is one of ``modules`` or inside one (mlscale.train.x is under mlscale.train;
    mlscale.train_flags is not)."""
    return any(name == m or name.startswith(m + ".") for m in modules)


PARTS = _parts()
# the bottom layer: small modules every part may use; they import nothing of mlscale but each other
BOTTOM = {"errors", "common", "rundir", "faultspec", "weights"}
# the top: the command line, the demo and the benchmarks may use any part, and no part uses them
TOP = {"bench", "demo", "cli"}


def _all_but(*allowed: str) -> tuple[str, ...]:
    """Every part but the bottom layer and ``allowed`` (a part's own modules are never forbidden to it)."""
    return tuple(sorted(f"mlscale.{p}" for p in PARTS - BOTTOM - set(allowed)))


# part -> the parts it must never import (higher rooms, or neighbours it must not know); every part is
# here or in TOP (test_every_part_has_a_place_in_the_layering), and none imports the top
FORBIDDEN = {
    **{part: _all_but() for part in BOTTOM},
    # a data set is rows and shards: no task, config, feature store or anything above
    "data": _all_but(),
    # feature repositories and services: used by tasks and serving, knowing neither
    "features": _all_but(),
    # a data set's fingerprint and the code version, for report.json
    "lineage": _all_but("data"),
    # a registry read of a run's configuration (and deploy's check of a job) imports no training
    "config": ("mlscale.train", "mlscale.serve", "mlscale.bench", "mlscale.registry", "mlscale.deploy",
               "mlscale.export"),
    "registry": ("mlscale.train", "mlscale.bench", "mlscale.serve", "mlscale.export", "mlscale.deploy"),
    "export": ("mlscale.train", "mlscale.bench", "mlscale.serve", "mlscale.deploy"),
    # serving does not borrow the training config's helpers
    "serve": ("mlscale.train", "mlscale.bench", "mlscale.config", "mlscale.deploy"),
    "tasks": ("mlscale.train", "mlscale.bench", "mlscale.serve", "mlscale.registry", "mlscale.export",
              "mlscale.deploy"),
    "train": ("mlscale.bench", "mlscale.serve", "mlscale.registry", "mlscale.export", "mlscale.deploy"),
    # the UI reads run directories, the registry and servers' own metrics: it runs none of them
    "ui": ("mlscale.train", "mlscale.bench", "mlscale.serve", "mlscale.export", "mlscale.deploy", "mlscale.config",
           "mlscale.tasks", "mlscale.features", "mlscale.data"),
    # manifests name the commands (mlscale train, mlscale serve) and never run their code
    "deploy": ("mlscale.bench", "mlscale.serve", "mlscale.export", "mlscale.features"),
}


def test_every_part_has_a_place_in_the_layering():
    unplaced = PARTS - TOP - set(FORBIDDEN)
    assert unplaced == set(), f"new parts: add them to FORBIDDEN (or TOP) in {Path(__file__).name}"


def test_no_part_imports_a_part_above_it():
    top = tuple(f"mlscale.{p}" for p in TOP)
    broken = []
    for part, forbidden in FORBIDDEN.items():
        for path in _files(part):
            broken += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(_imports(path))
                       if _under(name, forbidden + top) and not _under(name, (f"mlscale.{part}",))]
    assert broken == []


def test_no_import_circle_among_mlscale_modules():
    """Counted with the imports inside functions: such an import only hides a circle (a module that is
    half made when its function runs). The cure is the shared piece in a module below both."""
    shape = code_shape()
    assert shape.circles(shape.import_graph()) == []


def test_the_circle_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("from . import c\n")
    (package / "c.py").write_text("from .a import f\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    shape = code_shape()
    graph = shape.import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == set()  # an import for type checking never runs
    assert shape.circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


# What is slow to import (measured with `python -X importtime -c "import X"` on the 2-core CI machine: each
# 0.1-5 s; the stdlib modules mlscale uses cost a few ms) or an optional extra: the only third-party modules
# a function may import rather than its module. A dotted name is a part of torch that costs seconds more
# than torch itself.
HEAVY = {
    "torch", "torch.distributed.pipelining", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.launcher", "torch.utils.tensorboard", "safetensors.torch",
    "torchft", "transformers", "tokenizers", "jinja2", "onnx", "onnxruntime", "onnxscript", "mlflow",
    "matplotlib", "pandas", "pyarrow", "duckdb", "redis", "fsspec", "s3fs", "moto", "PIL", "opentelemetry",
    "numpy", "pydantic", "sqlalchemy", "starlette", "uvicorn", "uvloop", "httpx", "grpc", "prometheus_client",
    "yaml", "tqdm", "litserve", "fastapi", "playwright",
}
# imports inside functions that have another reason: file -> {module: why}
_HELP = "mlscale --help imports no server module (test_mlscale_help_imports_no_benchmark_no_server_and_no_torch)"
_LAZY = "a sub-command's module is imported when it runs (LazyParser): mlscale --help builds none of them"
IMPORTED_IN_FUNCTIONS = {
    "mlscale/cli/__init__.py": {"mlscale.cli.train": _LAZY},
    "mlscale/cli/plan.py": {"mlscale.cli.train": _LAZY},
    "mlscale/cli/models.py": {"mlscale.serve.share": _HELP},
    "mlscale/cli/rollout.py": {"mlscale.serve.share": _HELP, "mlscale.serve.promotion": _HELP},
}


def _heavy(names: set[str]) -> set[str]:
    """The entries of HEAVY that importing ``names`` pays for."""
    return {entry for entry in HEAVY for name in names if name == entry or name.startswith(entry + ".")}


def _imports_without_a_reason() -> list[str]:
    """Every import statement inside a function whose modules bring no heavy package that its own module
    does not already import when it is imported, as file:line module; and any reason no longer needed."""
    shape = code_shape()
    modules, written = shape.module_files(), shape.all_imports()
    top = shape.top_level_imports(written)

    @functools.cache
    def brings(module: str) -> frozenset[str]:
        return frozenset(_heavy(shape.imported_with(module, top) if module in modules else {module}))

    found = []
    unused = {(file, module) for file, reasons in IMPORTED_IN_FUNCTIONS.items() for module in reasons}
    for name, path in modules.items():
        file = str(path.relative_to(REPO))
        statements: dict[int, list[str]] = {}
        for i in written[name]:
            if i.in_function and not i.type_checking:
                statements.setdefault(i.line, []).append(i.module)
        for line, names in sorted(statements.items()):
            unused -= {(file, module) for module in names}
            if not set().union(*map(brings, names)) - brings(name) and not set(names) & set(
                    IMPORTED_IN_FUNCTIONS.get(file, {})):
                found.append(f"{file}:{line} {names[-1]}")
    return found + [f"{file}: {module} is in IMPORTED_IN_FUNCTIONS but imported in no function"
                    for file, module in sorted(unused)]


def test_every_import_inside_a_function_has_a_reason():
    """An import goes at the top of its module unless it is of a heavy or optional package (HEAVY) that
    the module does not import already, or of an mlscale module that brings one; anything else is named
    with its reason in IMPORTED_IN_FUNCTIONS. Hiding a circle is no reason (the circle test counts
    imports inside functions)."""
    found = _imports_without_a_reason()
    print("\n".join(found))
    assert found == []


def test_the_reason_check_sees_a_light_import_inside_a_function():
    shape = code_shape()
    top = shape.top_level_imports(shape.all_imports())
    assert _heavy(shape.imported_with("mlscale.cli.parsers", top)) == set()  # mlscale --help stays light
    assert "torch" in _heavy(shape.imported_with("mlscale.train.stages", top))
    assert _heavy({"torch.distributed.pipelining.schedules"}) == {"torch", "torch.distributed.pipelining"}


def test_reading_a_runs_config_the_way_the_registry_does_imports_no_training(tmp_path):
    """What the AST cannot see: a validator's import inside a function, a lazy name, a transitive import.
    The registry reads a run's config.json as ``TrainConfig(**run.read_config())``."""
    from mlscale.config import TrainConfig

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig(task="digits", workers=2).model_dump()))
    loaded = _modules_after("import mlscale.registry.models\n"
                            "from mlscale.config import TrainConfig\nfrom mlscale.rundir import RunDir\n"
                            f"TrainConfig(**RunDir({str(tmp_path)!r}).read_config())")
    assert sorted(m for m in loaded if _under(m, ("mlscale.train",))) == []


def test_the_ui_loads_no_torch():
    """`mlscale ui` on a login node or a laptop: the app, its run reader and the registry view import no
    torch (the registry's model loading is lazy)."""
    loaded = _modules_after("from mlscale.ui.app import build_app, UiSettings\nbuild_app(UiSettings())")
    assert sorted(m for m in loaded if m == "torch" or m.startswith(("torch.", "mlscale.train"))) == []
