"""Error types that the CLI maps to exit codes.

One type per kind of failure, so every command reports user mistakes the same way:
``UsageError`` (exit 2) is a bad value the user can fix; ``MlscaleError`` (exit 1) is anything else
that we can still explain in one paragraph instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

from mlscale.common.redact import redact_text


def first_line(error: object) -> str:
    """The first line of an error's text: drivers and libraries explain on several lines, and a
    one-line message is what the CLI prints."""
    return (str(error).strip().splitlines() or [""])[0]


class MlscaleError(Exception):
    """A failure explained to the user in its message; the CLI prints it and exits 1."""

    exit_code = 1


class UsageError(MlscaleError):
    """Bad usage or configuration: one line naming the bad value; the CLI exits 2."""

    exit_code = 2


class WorkerFailed(MlscaleError):
    """A training worker failed; the message names the rank and its error."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def describe_validation_error(error: Any, cli_names: dict[str, str] | None = None) -> str:
    """One line for a pydantic ``ValidationError``: the first bad key, its value and why, in the
    user's words (the flag's spelling: ``cli_names`` maps a field to its flag where they differ).
    Shared by every options model (training and serving), so both speak alike."""
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    names = cli_names or {}
    key = names.get(loc, loc.replace("_", "-")) if loc else ""
    if first["type"] == "extra_forbidden":
        return f"unknown configuration key '{loc}'"
    message = first["msg"].removeprefix("Value error, ")
    if not key:
        return f"bad configuration: {message}"
    return f"bad value {key}={first.get('input')!r}: {message}"


def report_error(exc: MlscaleError) -> int:
    """An error of mlscale's printed in one line on stderr (every URL in it without its password), as
    every command prints one; returns its exit code."""
    prefix = "mlscale: error: " if isinstance(exc, UsageError) else "mlscale: "
    print(f"{prefix}{redact_text(str(exc))}", file=sys.stderr)
    return exc.exit_code
