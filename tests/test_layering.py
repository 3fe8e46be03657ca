"""The layering is visible and kept: lower parts never import higher ones, and the command tree is
built without importing what only one sub-command needs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


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


def _root_lazy_names() -> dict[str, str]:
    """``mlscale/__init__.py``'s lazy names (``from mlscale import fit`` imports mlscale.train.launcher)."""
    for node in ast.walk(ast.parse((PACKAGE / "__init__.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_names":
            return ast.literal_eval(node.args[1])
    return {}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports count too); relative
    imports resolved, and a name imported from the package root counted as the module it comes from."""
    lazy = _root_lazy_names()
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module == "mlscale":
                found |= {lazy.get(alias.name, f"mlscale.{alias.name}") for alias in node.names}
            elif module:
                found.add(module)
    return found


def _under(name: str, modules: tuple[str, ...]) -> bool:
    """``name`` is one of ``modules`` or inside one (mlscale.train.x is under mlscale.train;
    mlscale.train_flags is not)."""
    return any(name == m or name.startswith(m + ".") for m in modules)


PARTS = _parts()
# the bottom layer: small modules every part may use; they import nothing of mlscale but each other
BOTTOM = {"errors", "io", "rundir", "dtypes", "redact", "safe_path", "lazy", "declarations", "display",
          "plotting", "faultspec", "weights", "connections", "log_limits"}
# the top: the command line, the demo and the benchmarks may use any part, and no part uses them
TOP = {"bench", "demo"} | {p for p in PARTS if p == "cli" or p.startswith("cli_")}


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
