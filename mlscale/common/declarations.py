"""Is a name declared, before anything is imported? A config file, a run directory and a registry row
are data: the module they name is imported only once its source shows the declaration mlscale looks
for (``@declare_task`` on that factory, a ``declare_repository(...)`` call), because importing a module
runs its top-level code (``somepkg.__main__`` is a whole program).

The module is located the way ``import`` locates it (the finders on ``sys.meta_path``, the Python path
as it is), without executing any module: not even its parent packages. Its source is read and parsed,
never run. A module that is a program (a ``__main__`` part) or whose source cannot be read (compiled
only) is never imported for a name in data.
"""

from __future__ import annotations

import ast
import sys
from importlib.machinery import ModuleSpec
from typing import Any


class NotFound(Exception):
    """No finder on the Python path knows the module."""


def find_spec_quietly(module_name: str) -> ModuleSpec:
    """The spec ``import module_name`` would use, found without importing it or its parents."""
    if module_name in sys.modules:
        spec = getattr(sys.modules[module_name], "__spec__", None)
        if spec is not None:
            return spec
    parent, _, _ = module_name.rpartition(".")
    path: list[str] | None = None
    if parent:
        if parent in sys.modules and hasattr(sys.modules[parent], "__path__"):
            path = list(sys.modules[parent].__path__)
        else:
            locations = find_spec_quietly(parent).submodule_search_locations
            if locations is None:
                raise NotFound(f"{parent!r} is not a package")
            path = list(locations)
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(module_name, path) if find is not None else None
        if spec is not None:
            return spec
    raise NotFound(f"No module named {module_name!r}")


def is_program(module_name: str) -> bool:
    """``pkg.__main__`` (what ``python -m pkg`` runs): importing it runs the program."""
    return "__main__" in module_name.split(".")


def module_tree(module_name: str) -> ast.Module | None:
    """The parsed source of ``module_name`` (never executed); None when it has no readable source.
    Raises ``NotFound``, or ``SyntaxError`` for a source that does not parse."""
    spec = find_spec_quietly(module_name)
    get_source = getattr(spec.loader, "get_source", None)
    if get_source is None:
        return None
    try:
        source = get_source(module_name)
    except (ImportError, OSError):
        return None
    if not source:
        return None
    return ast.parse(source, filename=spec.origin or module_name)


def _aliases(tree: ast.Module, name: str) -> set[str]:
    """How the module may spell ``name``: itself, and what it was imported as (``import ... as``)."""
    spelled = {name}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            spelled |= {alias.asname for alias in node.names if alias.name == name and alias.asname}
    return spelled


def _is(expr: Any, spelled: set[str]) -> bool:
    """``expr`` names the function: ``declare_task``, an alias of it, or ``anything.declare_task``."""
    return (isinstance(expr, ast.Name) and expr.id in spelled) or \
        (isinstance(expr, ast.Attribute) and expr.attr in spelled)


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """The module's top-level statements and everything in them, except the bodies of functions (which
    do not run on import) and classes (walked separately for their methods)."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


def declares_function(tree: ast.Module, qualname: str, decorator: str) -> bool:
    """Whether the module declares ``qualname`` with ``decorator``: as a decorator of that function (at
    the top level, or a method of a top-level class), or called on it at the top level
    (``decorator(qualname)``)."""
    spelled = _aliases(tree, decorator)
    *owners, name = qualname.split(".")
    body: list[ast.stmt] = tree.body
    for owner in owners:
        classes = [node for node in body if isinstance(node, ast.ClassDef) and node.name == owner]
        if not classes:
            return False
        body = classes[-1].body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name and \
                any(_is(d, spelled) for d in node.decorator_list):
            return True
    if owners:
        return False
    return any(isinstance(node, ast.Call) and _is(node.func, spelled) and node.args
               and isinstance(node.args[0], ast.Name) and node.args[0].id == name for node in _top_level(tree))


def calls_at_top_level(tree: ast.Module, function: str) -> bool:
    """Whether the module calls ``function`` when it is imported (a top-level statement, not a function)."""
    spelled = _aliases(tree, function)
    return any(isinstance(node, ast.Call) and _is(node.func, spelled) for node in _top_level(tree))
