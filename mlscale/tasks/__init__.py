"""Built-in tasks and the resolver that also accepts a user's ``package.module:factory``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from mlscale.errors import UsageError
from mlscale.tasks.base import Task, TensorData
from mlscale.tasks.digits import make_digits, make_digits_cnn
from mlscale.tasks.synthetic import make_synthetic

__all__ = ["BUILTIN_TASKS", "Task", "TensorData", "make_task"]

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    "digits": make_digits,
    "digits-cnn": make_digits_cnn,
    "synthetic": make_synthetic,
}


def _import_factory(path: str) -> Callable[..., Task]:
    module_name, _, attr = path.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like uvicorn: the user's own modules resolve from where they run
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"bad value task={path!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"bad value task={path!r}: {module_name!r} has no callable {attr!r}")
    return factory


def resolve_factory(name: str) -> Callable[..., Task]:
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if ":" in name:
        return _import_factory(name)
    known = ", ".join(BUILTIN_TASKS)
    raise UsageError(f"bad value task={name!r}: unknown task (built-in: {known}; or 'package.module:factory')")


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """Build a task by name; bad options become a ``UsageError`` naming the task."""
    factory = resolve_factory(name)
    try:
        task = factory(**(options or {}))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad task options for {name!r}: {exc}") from None
    if not isinstance(task, Task):
        raise UsageError(f"bad value task={name!r}: factory returned {type(task).__name__}, not mlscale.Task")
    return task
