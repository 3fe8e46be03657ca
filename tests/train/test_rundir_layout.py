"""The run directory has one owner: ``mlscale/rundir.py``'s ``RunDir`` names every path of its layout, and no
other module under mlscale/ (training, fault tolerance, plots, the demo, the benchmarks) builds one by hand.

A grep-style check of the source (its syntax tree, so docstrings, comments and messages may still mention
``logs/faults.jsonl``): a string that goes into a path (``/``, ``Path(...)``, ``joinpath``, ``glob``,
``with_suffix``...) must not spell a name of the layout, and nothing joins onto a run directory's folders."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mlscale"
OWNER = PACKAGE / "rundir.py"

# The names of the run directory's layout (docs/architecture.md), as RunDir spells them.
LAYOUT = ("config.json", "plan.json", "metrics.jsonl", "report.json", "checkpoints", "final", "model.safetensors",
          "heartbeat", "attempt", "recovery.jsonl", "logs", "faults.jsonl", "failures.jsonl", "traceback",
          "rejoined", "elastic", "finished.json", "replica", "torchft", "agents", "ready", "member", "tensorboard",
          "plots", "training.png", "serving.png", "serving.json", "data-cache")
SPELLS = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, LAYOUT)) + r")(?![A-Za-z0-9_])")
PATH_CALLS = {"Path", "PurePath", "joinpath", "glob", "rglob", "with_suffix", "with_name", "with_stem", "join"}
# Joining onto a RunDir's own folders by hand (run_dir.path / ..., run.logs / ...).
JOINED = re.compile(r"\b(run|run_dir|rundir|self\.run_dir)\.(path|logs|checkpoints)\s*/")


def _text(node: ast.AST) -> str | None:
    """The text of a string literal or f-string (``{}`` for what is formatted in), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def _path_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string that goes into a path: an operand of ``/``, an argument of a path call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            operands = [*node.args, *(keyword.value for keyword in node.keywords)] if name in PATH_CALLS else []
        else:
            continue
        found += [(operand.lineno, text) for operand in operands if (text := _text(operand)) is not None]
    return found


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path != OWNER)


def _offences(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    source = path.read_text()
    where = path.relative_to(root)
    offences = [f"{where}:{line}: {text!r} spells the run directory's {match.group(1)!r}"
                for line, text in _path_strings(ast.parse(source)) if (match := SPELLS.search(text))]
    offences += [f"{where}:{number}: joins onto a run directory's folder by hand: {line.strip()}"
                 for number, line in enumerate(source.splitlines(), 1) if JOINED.search(line)]
    return offences


def test_no_module_but_rundir_builds_a_path_of_the_run_directory():
    offences = [offence for path in _modules() for offence in _offences(path)]
    assert offences == [], "ask RunDir (mlscale/rundir.py) for these paths:\n" + "\n".join(offences)


@pytest.mark.parametrize("source", [
    'logs = run_dir.path / "logs"',
    'beat = directory / f"attempt{attempt}-rank{rank}"',
    'path = Path(run_dir) / "logs" / "faults.jsonl"',
    'paths = directory.glob(f"replica*.jsonl")',
    'log = path.with_suffix(".torchft.log")',
    'cache = base.joinpath("data-cache", f"rank{member}")',
])
def test_the_check_sees_a_path_built_by_hand(tmp_path, source):
    module = tmp_path / "handmade.py"
    module.write_text(source + "\n")
    assert _offences(module, root=tmp_path)


def test_the_check_leaves_messages_docstrings_and_other_folders_alone(tmp_path):
    module = tmp_path / "fine.py"
    module.write_text('"""Writes logs/faults.jsonl through RunDir."""\n'
                      'print("see report.json and metrics.jsonl")\n'
                      'weights = folder / "artifacts" / name\n'
                      'if "tensorboard" in config.records.log:\n    pass\n')
    assert _offences(module, root=tmp_path) == []
