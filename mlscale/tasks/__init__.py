"""Built-in tasks and the resolver that also accepts a user's declared ``package.module:factory``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlscale.errors import UsageError
from mlscale.tasks.base import Task, TensorData
from mlscale.tasks.declared import declare_task, declared_factory
from mlscale.tasks.digits import make_digits, make_digits_cnn
from mlscale.tasks.synthetic import make_synthetic

__all__ = ["BUILTIN_TASKS", "Task", "TensorData", "declare_task", "make_task"]

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    "digits": make_digits,
    "digits-cnn": make_digits_cnn,
    "synthetic": make_synthetic,
}


def resolve_factory(name: str) -> Callable[..., Task]:
    """The factory of a built-in or declared task; anything else is refused before it is called."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    factory = declared_factory(name)
    if factory is None:
        known = ", ".join(BUILTIN_TASKS)
        raise UsageError(f"bad value task={name!r}: unknown task (built-in: {known}; or a declared "
                         "'package.module:factory')")
    return factory


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
