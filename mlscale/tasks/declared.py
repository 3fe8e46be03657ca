"""Which task factories mlscale may call: a config file, a run directory and a registry row are data.

A task named in data is only a string. mlscale calls a factory only when it is built in, declared
with :func:`declare_task` in the module that defines it, or declared by an installed package in the
``mlscale.tasks`` entry-point group. Anything else (``os:system``, ``subprocess:run``) is refused
before it is called: with a registry shared through PostgreSQL, calling whatever a row names would
be code execution on every host that loads a model. Nor is a module imported to find out: its
source must show the declaration first (read and parsed, never run; ``mlscale.common.declarations``), so a
row naming ``somepkg.__main__:main`` or any module that declares nothing runs none of its code.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar

from mlscale.common.declarations import NotFound, declares_function, is_program, module_tree
from mlscale.errors import UsageError

ENTRY_POINT_GROUP = "mlscale.tasks"
HOW_TO_DECLARE = ("decorate the factory with @mlscale.declare_task, or declare it in the 'mlscale.tasks' "
                  "entry-point group of an installed package")

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
F = TypeVar("F", bound=Callable[..., Any])
_DECLARED: dict[str, Callable[..., Any]] = {}


def declare_task(factory: F) -> F:
    """Declare ``factory`` as a task that mlscale may build by its path, ``package.module:function``.

    The declaration happens when the module is imported, so only code that someone installed or put
    on the Python path, and marked as a task, can ever be called from a configuration."""
    _DECLARED[task_path(factory)] = factory
    return factory


def task_path(factory: Callable[..., Any]) -> str:
    return f"{factory.__module__}:{factory.__qualname__}"


def _entry_point(name: str) -> EntryPoint | None:
    """The installed entry point named ``name`` or pointing at ``name`` (``package.module:function``)."""
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if name in (point.name, point.value.replace(" ", "")):
            return point
    return None


def _import(name: str, module_name: str) -> None:
    """Import the module that should declare ``name``, from the Python path as it is (mlscale never
    adds the current directory); any failure of the import is one line, not a traceback."""
    try:
        importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"bad value task={name!r}: cannot import {module_name!r} ({exc}); "
                         "is it installed or on PYTHONPATH?") from None
    except Exception as exc:  # the user's module itself is broken (SyntaxError, NameError, ...)
        raise UsageError(f"bad value task={name!r}: importing {module_name!r} failed: {type(exc).__name__}: "
                         f"{exc}") from None


def _check_source(name: str, module_name: str, qualname: str) -> None:
    """Refuse ``name`` unless its module's source declares it with ``@declare_task``: read and parsed,
    not run, and the module is found without importing it or its packages. A standard-library module,
    a program (``pkg.__main__``), a module already imported without declaring it and one without
    readable source hold no declared task."""
    undeclared = UsageError(f"bad value task={name!r}: not a declared mlscale task; {HOW_TO_DECLARE}")
    if module_name.split(".")[0] in sys.stdlib_module_names or is_program(module_name) \
            or module_name in sys.modules:  # an imported module declared what it declares already
        raise undeclared
    try:
        tree = module_tree(module_name)
    except NotFound as exc:
        raise UsageError(f"bad value task={name!r}: cannot import {module_name!r} ({exc}); "
                         "is it installed or on PYTHONPATH?") from None
    except (SyntaxError, ValueError) as exc:  # the user's module is broken: one line, nothing run
        raise UsageError(f"bad value task={name!r}: importing {module_name!r} failed: {type(exc).__name__}: "
                         f"{exc}") from None
    except Exception as exc:  # a finder on the path failed
        raise UsageError(f"bad value task={name!r}: cannot locate {module_name!r} ({type(exc).__name__}: "
                         f"{exc})") from None
    if tree is None or not declares_function(tree, qualname, "declare_task"):
        raise undeclared


def declared_factory(name: str) -> Callable[..., Any] | None:
    """The declared factory for ``name``, importing its module (never calling it); None if unknown."""
    point = _entry_point(name)
    if point is not None:
        try:
            return point.load()
        except Exception as exc:  # the installed package is broken: one line, not a traceback
            raise UsageError(f"bad value task={name!r}: its entry point {point.value!r} does not load "
                             f"({type(exc).__name__}: {exc})") from None
    module_name, sep, qualname = name.partition(":")
    if not sep:
        return None
    if not _PATH.fullmatch(name):
        raise UsageError(f"bad value task={name!r}: expected package.module:factory")
    if name not in _DECLARED:
        _check_source(name, module_name, qualname)  # before anything is imported
        _import(name, module_name)
    factory = _DECLARED.get(name)
    if factory is None:
        raise UsageError(f"bad value task={name!r}: not a declared mlscale task; {HOW_TO_DECLARE}")
    return factory
