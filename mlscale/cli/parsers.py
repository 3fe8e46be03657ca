"""The command's parsers: one line for a mistake, no abbreviations, and sub-commands built lazily.

``mlscale --help`` and ``mlscale train`` build the whole command tree; building every sub-command's
arguments would import every benchmark (numpy, matplotlib's helpers) and the server's options model
(pydantic) for nothing. A ``LazyParser`` imports its module on first use instead.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from mlscale.common.redact import redact_text


class Parser(argparse.ArgumentParser):
    """argparse as a user expects it of one tool: a mistake is one line naming it (the usage stays in
    ``--help``), exit 2; and no silent abbreviations (``--worker 2`` is refused, not taken as
    ``--workers``, so a typo cannot pick another option once one is added).

    ``intermixed``: positionals may stand on both sides of the options (``mlscale export URI --format hf
    DIR``); argparse alone fills every positional from the first run of them and leaves DIR over."""

    def __init__(self, *args: Any, intermixed: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._intermixed = intermixed

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        if not self._intermixed:
            return super().parse_known_args(args, namespace)
        self._intermixed = False  # argparse's intermixed parsing calls parse_known_args itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = True

    def error(self, message: str) -> NoReturn:
        # argparse quotes the bad value, which may be a URL with a password
        self.exit(2, f"{self.prog}: error: {redact_text(message)} (see {self.prog} --help)\n")


class LazyParser(Parser):
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


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else a one-line error naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def int_list(minimum: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each >= ``minimum`` (``1,2,4``)."""
    one = int_at_least(minimum)

    def parse(text: str) -> list[int]:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1,2")
        return values

    parse.__name__ = "list of integers"
    return parse


def add_out_option(p: argparse.ArgumentParser, name: str) -> None:
    """``--out`` of a benchmark: by default a new folder under ``runs/``, so a run never overwrites the
    committed results in ``bench/results/`` unless asked to (``--out bench/results/NAME``)."""
    default = f"runs/bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    p.add_argument("--out", default=default, metavar="DIR",
                   help=f"folder for {name}.json and {name}.png (default: a new runs/bench-{name}-TIME; the "
                   f"committed results are in bench/results/{name})")


def name_list(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``known``."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}: expected comma-separated names "
                                             f"from {', '.join(known)}")
        return names

    parse.__name__ = "list of names"
    return parse


def float_above(minimum: float) -> Callable[[str], float]:
    """An argparse type: a number > ``minimum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > minimum:
            raise argparse.ArgumentTypeError(f"{value:g} must be more than {minimum:g}")
        return value

    parse.__name__ = f"number > {minimum:g}"
    return parse
