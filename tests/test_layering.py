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


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


# part -> the parts it must never import (higher rooms, or neighbours it must not know)
FORBIDDEN = {
    "registry": ("mlscale.train", "mlscale.bench", "mlscale.serve"),
    "export": ("mlscale.train", "mlscale.bench", "mlscale.serve"),
    "serve": ("mlscale.train", "mlscale.bench"),
    "tasks": ("mlscale.train", "mlscale.bench", "mlscale.serve", "mlscale.registry"),
    "data": ("mlscale.train", "mlscale.bench", "mlscale.serve", "mlscale.registry"),
    "train": ("mlscale.bench", "mlscale.serve", "mlscale.registry", "mlscale.export"),
    # manifests name the commands (mlscale train, mlscale serve) and never run their code
    "deploy": ("mlscale.bench", "mlscale.serve", "mlscale.export", "mlscale.features"),
}


def test_no_part_imports_a_part_above_it():
    broken = []
    for part, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / "mlscale" / part).rglob("*.py")):
            broken += [f"{path.relative_to(REPO)} imports {name}" for name in _imports(path)
                       if name.startswith(forbidden)]
    assert broken == []
