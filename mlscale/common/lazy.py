"""Names a package exports but imports on first use (PEP 562), so that importing the package stays
cheap: ``mlscale serve`` of an ONNX model never loads torch through a package's ``__init__``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each name in ``names`` comes from its module."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *names})

    return __getattr__, __dir__
