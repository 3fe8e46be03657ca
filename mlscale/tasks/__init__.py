"""Built-in tasks and the resolver that also accepts a user's declared ``package.module:factory``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mlscale.errors import UsageError
from mlscale.tasks.base import Task, TensorData
from mlscale.tasks.declared import declare_task, declared_factory
from mlscale.tasks.digits import make_digits, make_digits_cnn
from mlscale.tasks.featured import make_features
from mlscale.tasks.images import make_images
from mlscale.tasks.synthetic import make_synthetic
from mlscale.tasks.tabular import make_parquet
from mlscale.tasks.text import make_text
from mlscale.tasks.tinylm import make_tinylm

__all__ = ["BUILTIN_TASKS", "Task", "TensorData", "declare_task", "make_task"]

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    "digits": make_digits,
    "digits-cnn": make_digits_cnn,
    "synthetic": make_synthetic,
    "tinylm": make_tinylm,
    "parquet": make_parquet,
    "features": make_features,
    "images": make_images,
    "text": make_text,
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


def check_options(name: str, factory: Callable[..., Task], options: dict[str, Any]) -> None:
    """Refuse an option the factory does not take, or a value whose type does not fit the default's
    (``--task-opt width=abc``), with one line naming it, before the factory runs."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for key, value in options.items():
        parameter = parameters.get(key)
        if key in RUN_SETTINGS and parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            raise UsageError(f"bad value task-opt {key}={value!r}: the run gives task {name!r} its "
                             f"--{key.replace('_', '-')}, not a task option")
        if parameter is None:
            if takes_any:
                continue
            known = ", ".join(p for p in parameters if parameters[p].kind is not inspect.Parameter.VAR_POSITIONAL)
            raise UsageError(f"bad value task-opt {key}={value!r}: task {name!r} has no option {key!r} "
                             f"(options: {known or 'none'})")
        default = parameter.default
        if default is inspect.Parameter.empty or default is None or isinstance(value, type(default)):
            continue
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            continue
        raise UsageError(f"bad value task-opt {key}={value!r}: must be {type(default).__name__} like the default "
                         f"{default!r}")


RUN_SETTINGS = ("data_workers",)  # the run's settings a factory may take, keyword-only, besides its options


def _run_settings(factory: Callable[..., Task]) -> list[str]:
    """The run settings ``factory`` takes (keyword-only parameters of those names)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    return [key for key in RUN_SETTINGS
            if key in parameters and parameters[key].kind is inspect.Parameter.KEYWORD_ONLY]


def make_task(name: str, options: dict[str, Any] | None = None, *, data_workers: int | str = 0) -> Task:
    """Build a task by name; bad options become a ``UsageError`` naming the task. A factory with a keyword-only
    parameter of a name in ``RUN_SETTINGS`` gets that setting of the run (``--data-workers``: the text task
    tokenizes in that many processes)."""
    factory = resolve_factory(name)
    check_options(name, factory, options or {})
    settings = {"data_workers": data_workers}
    try:
        task = factory(**(options or {}), **{key: settings[key] for key in _run_settings(factory)})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad task options for {name!r}: {exc}") from None
    if not isinstance(task, Task):
        raise UsageError(f"bad value task={name!r}: factory returned {type(task).__name__}, not mlscale.Task")
    return task
