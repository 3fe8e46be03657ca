"""The shape of the mlscale package, read from its source: files, lines, import circles, imports inside
functions, the largest files and functions.

    python bench/code_shape.py            # a table
    python bench/code_shape.py --json     # the same numbers as JSON

An import counts wherever it is written (inside a function too), since a function-level import is still
a dependency; only imports under ``if TYPE_CHECKING:`` are left out, because they never run.
Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "mlscale"


@dataclass(frozen=True)
class Import:
    """One imported module as a file names it (``from X import Y`` gives X, or X.Y when Y is a module)."""

    module: str
    line: int
    in_function: bool
    type_checking: bool


def module_files(root: Path = REPO, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    """A package's names imported on first use (``lazy_names(__name__, {name: module})``): importing
    such a name imports its module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_names" and len(node.args) == 2:
            table = node.args[1]
            if isinstance(table, ast.Dict):
                return ast.literal_eval(table)
            if isinstance(table, ast.DictComp) and isinstance(table.value, ast.Constant):
                return {name: table.value.value for name in _literal_names(tree, table.generators[0].iter)}
    return {}


def _literal_names(tree: ast.Module, node: ast.expr) -> list[str]:
    """A literal tuple or list of names, or a module-level name (``__all__``) bound to one."""
    if isinstance(node, ast.Name):
        for statement in tree.body:
            if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == node.id for t in statement.targets):
                return list(ast.literal_eval(statement.value))
        return []
    return list(ast.literal_eval(node))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _walk(nodes, in_function: bool = False, type_checking: bool = False):
    """Every import statement with where it sits: inside a function, under ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _walk(node.body, in_function, True)
            yield from _walk(node.orelse, in_function, type_checking)
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from _walk(ast.iter_child_nodes(node), inner, type_checking)


def imports(path: Path, modules: dict[str, Path], root: Path = REPO) -> list[Import]:
    """Every module ``path`` imports. Relative imports are resolved; ``from X import Y`` names X.Y when
    that is a module of the package, else X, and also Y's module when X imports Y on first use."""
    parts = path.relative_to(root).with_suffix("").parts
    package = list(parts[:-1])
    lazy = {}
    found = []
    for node, in_function, type_checking in _walk(ast.parse(path.read_text(), str(path)).body):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in modules:
                    names.append(child)
                    continue
                names.append(base)
                if base in modules and modules[base].name == "__init__.py":
                    if base not in lazy:
                        lazy[base] = _lazy_table(ast.parse(modules[base].read_text()))
                    if alias.name in lazy[base]:
                        names.append(lazy[base][alias.name])
        found += [Import(name, node.lineno, in_function, type_checking) for name in dict.fromkeys(names)]
    return found


def import_graph(root: Path = REPO, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (at any depth, not under TYPE_CHECKING)."""
    modules = module_files(root, package)
    return {name: {i.module for i in imports(path, modules, root) if i.module in modules and i.module != name
                   and not i.type_checking}
            for name, path in modules.items()}


def all_imports(root: Path = REPO, package: str = PACKAGE) -> dict[str, list[Import]]:
    """Module -> every import it writes (:func:`imports`), each file read once."""
    modules = module_files(root, package)
    return {name: imports(path, modules, root) for name, path in modules.items()}


def top_level_imports(found: dict[str, list[Import]]) -> dict[str, set[str]]:
    """Module -> every module (of any package) it imports when it is itself imported: its imports outside
    functions and outside ``if TYPE_CHECKING:``, and the package it sits in (``found`` from
    :func:`all_imports`)."""
    top = {}
    for name, written in found.items():
        parent = name.rpartition(".")[0]
        top[name] = {i.module for i in written if not i.in_function and not i.type_checking} | {parent} - {"", name}
    return top


def imported_with(module: str, top: dict[str, set[str]]) -> set[str]:
    """Every module that importing ``module`` imports, through the package's modules at any depth (``top``
    from :func:`top_level_imports`); a module outside the package counts as itself, not what it imports."""
    seen = {module}
    work = [module]
    while work:
        for child in top.get(work.pop(), ()):
            if child not in seen:
                seen.add(child)
                work.append(child)
    return seen


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def _kind(module: str, package: str) -> str:
    top = module.split(".")[0]
    if top == package:
        return "mlscale"
    return "stdlib" if top in sys.stdlib_module_names else "third_party"


def shape(root: Path = REPO, package: str = PACKAGE, top: int = 10) -> dict:
    modules = module_files(root, package)
    lines = {}
    functions = []
    in_functions = {"mlscale": 0, "stdlib": 0, "third_party": 0}
    files_with = set()
    for name, path in modules.items():
        source = path.read_text()
        lines[str(path.relative_to(root))] = len(source.splitlines())
        functions += [(f"{path.relative_to(root)}:{f}", n) for f, n in _functions(ast.parse(source))]
        statements = {}
        for i in imports(path, modules, root):
            if i.in_function and not i.type_checking:
                statements.setdefault(i.line, _kind(i.module, package))
        for kind in statements.values():
            in_functions[kind] += 1
        if statements:
            files_with.add(name)
    found = circles(import_graph(root, package))
    return {
        "files": len(modules),
        "lines": sum(lines.values()),
        "circles": found,
        "imports_in_functions": {"total": sum(in_functions.values()), **in_functions, "files": len(files_with)},
        "largest_files": [{"file": f, "lines": n} for f, n in sorted(lines.items(), key=lambda x: -x[1])[:top]],
        "largest_functions": [{"function": f, "lines": n} for f, n in sorted(functions, key=lambda x: -x[1])[:top]],
    }


def render(result: dict) -> str:
    counts = result["imports_in_functions"]
    out = [f"files                  {result['files']}",
           f"lines                  {result['lines']}",
           f"import circles         {len(result['circles'])}",
           *(f"  {' <-> '.join(c)}" for c in result["circles"]),
           f"imports in functions   {counts['total']} in {counts['files']} files "
           f"(mlscale {counts['mlscale']}, third-party {counts['third_party']}, stdlib {counts['stdlib']})",
           "largest files"]
    out += [f"  {f['lines']:6d}  {f['file']}" for f in result["largest_files"]]
    out.append("largest functions")
    out += [f"  {f['lines']:6d}  {f['function']}" for f in result["largest_functions"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest files and functions")
    args = parser.parse_args(argv)
    result = shape(top=args.top)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
