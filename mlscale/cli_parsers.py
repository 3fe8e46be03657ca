"""A sub-command parser whose arguments are added only when that sub-command is the one run.

``mlscale --help`` and ``mlscale train`` build the whole command tree; building every sub-command's
arguments would import every benchmark (numpy, matplotlib's helpers) and the server's options model
(pydantic) for nothing. A ``LazyParser`` imports its module on first use instead.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any


class LazyParser(argparse.ArgumentParser):
    """``arguments``: ``module:function`` (mlscale's own code) that adds this parser's arguments; the
    module docstring's second paragraph becomes the description unless one is given."""

    def __init__(self, *args: Any, arguments: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments = arguments

    def _load(self) -> None:
        if not self._arguments:
            return
        module_name, _, function = self._arguments.partition(":")
        self._arguments = ""
        module = importlib.import_module(module_name)
        getattr(module, function)(self)
        paragraphs = (module.__doc__ or "").split("\n\n")
        if self.description is None and len(paragraphs) > 1:
            self.description = paragraphs[1]

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()
