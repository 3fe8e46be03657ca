"""The promotion gate: is a challenger (a canary or a shadow) ready to replace the version a running
server serves? Judged from the server's own figures (GET /v2/models/NAME/compare).

In the library, not in the command, so that a Python pipeline gates a promotion with the same checks
and the same words as ``mlscale models compare``: ``fetch_comparison`` reads the report, ``judge``
picks the two versions and runs every check that applies to the challenger's role. Standard library
only (no server, no numpy): the command imports it when it runs. A check's text names the flag that
sets its threshold, since the command prints it as it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from mlscale.errors import MlscaleError, UsageError

Row = dict[str, Any]  # one version's figures in the report, as the server answers them (JSON)


@dataclass(frozen=True)
class Thresholds:
    """What a challenger must meet; the defaults are ``mlscale models compare``'s."""

    min_requests: int = 100  # answers the challenger must have given to be judged
    max_error_increase: float = 1.0  # canary: points of error rate above the champion's, at most
    max_p99_ratio: float = 1.5  # p99 over the champion's, at most...
    p99_slack_ms: float = 5.0  # ...or at most this much above it (histogram buckets)
    min_latency_answers: int = 1000  # answers each side needs before its p99 is judged
    min_agreement: float = 0.99  # shadow: share of answers agreeing with the served ones, at least
    max_mean_abs_diff: float | None = None  # shadow: mean absolute difference, at most (None: not checked)


@dataclass(frozen=True)
class Verdict:
    """The two versions judged, and (passed, what) of every check that applied."""

    champion: Row
    challenger: Row
    checks: list[tuple[bool, str]]

    @property
    def passed(self) -> bool:
        return all(ok for ok, _ in self.checks)


def fetch_comparison(server: str, name: str) -> dict[str, Any]:
    """The server's comparison report; one line (never a traceback) when the server cannot be reached or
    fails (exit 1), refuses (4xx, its error: exit 2) or answers something that is not a report (exit 2:
    --server names something other than an `mlscale serve`)."""
    url = f"{server.rstrip('/')}/v2/models/{name}/compare"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:  # 4xx: the name or the URL is wrong (2); 5xx: the server's (1)
        error = UsageError if exc.code < 500 else MlscaleError
        raise error(f"{url}: {exc.code} {_error_of(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise MlscaleError(f"cannot reach the server at {server}: {getattr(exc, 'reason', exc)}") from None
    try:
        report = json.loads(body)
    except ValueError:
        report = None
    if not _is_report(report):
        raise UsageError(f"{url} did not answer a comparison report (it began {_error_of(body)!r}): is {server} an "
                         "`mlscale serve`?")
    return report


def _error_of(body: bytes) -> str:
    """An error answer's message, in one line of at most 200 characters: its JSON ``error``, or the text."""
    text = body.decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError):  # not JSON, or JSON but not an object
        text = str(json.loads(text).get("error", text))
    line = " ".join(text.split())
    return line if len(line) <= 200 else line[:197] + "..."


def _is_report(report: Any) -> bool:
    """A comparison report: the fields ``checks`` and the side-by-side read, of the types they read."""
    if not isinstance(report, dict) or not isinstance(report.get("versions"), list):
        return False
    fields = ("version", "uri", "role", "aliases", "success", "failed")
    return all(isinstance(row, dict) and all(field in row for field in fields) for row in report["versions"])


def _is(row: Row, wanted: str) -> bool:
    """The challenger is named as the server's --canary or --shadow names it: a version, an alias or a URI."""
    return wanted == row["version"] or wanted in row["aliases"] or row["uri"].endswith(f"@{wanted}")


def judge(report: dict[str, Any], name: str, challenger: str, thresholds: Thresholds, server: str) -> Verdict:
    """The served version (the champion) and ``challenger`` picked from ``report`` and judged; a
    UsageError (exit 2) when the server holds no such canary or shadow (``server`` names it there)."""
    rows = report["versions"]
    champion = next((row for row in rows if row["role"] == "primary"), None)
    picked = next((row for row in rows if row["role"] != "primary" and _is(row, challenger)), None)
    if champion is None or picked is None:
        held = ", ".join(f"v{row['version']} ({row['role']}, {row['uri']})" for row in rows)
        raise UsageError(f"the server at {server} holds no canary or shadow {challenger!r} of {name} "
                         f"(it holds {held}); start it with --canary or --shadow")
    return Verdict(champion, picked, checks(champion, picked, thresholds))


def checks(champion: Row, challenger: Row, thresholds: Thresholds) -> list[tuple[bool, str]]:
    """(passed, what) of every check that applies to the challenger's role."""
    t = thresholds
    found: list[tuple[bool, str]] = []
    shadow = challenger.get("shadow")
    answered = shadow["compared"] if shadow else challenger["success"] + challenger["failed"]
    found.append((answered >= t.min_requests, f"{answered} answers to judge (at least {t.min_requests}: "
                  "--min-requests)"))
    ours, theirs = (shadow["p99_ms"], shadow["served_p99_ms"]) if shadow else (challenger["p99_ms"], champion["p99_ms"])
    fewest = answered if shadow else min(answered, champion["success"] + champion["failed"])
    if ours is not None and theirs and fewest < t.min_latency_answers:
        found.append((True, f"p99 {format_ms(ours)} vs {format_ms(theirs)}: not judged, {fewest} answers (at least "
                      f"{t.min_latency_answers}: --min-latency-answers)"))
    elif ours is not None and theirs:
        ratio = ours / theirs
        passed = ratio <= t.max_p99_ratio or ours <= theirs + t.p99_slack_ms
        found.append((passed, f"p99 {format_ms(ours)} vs {format_ms(theirs)}: x{ratio:.2f} (at most "
                      f"x{t.max_p99_ratio:g}, or {t.p99_slack_ms:g} ms more: --max-p99-ratio, --p99-slack-ms)"))
    if shadow:
        agreement = shadow["agreement"]
        found.append((agreement is not None and agreement >= t.min_agreement,
                      f"agreement {format_share(agreement)} (at least {t.min_agreement:.2%}: --min-agreement)"))
        if t.max_mean_abs_diff is not None:
            difference = shadow["mean_abs_diff"]
            found.append((difference is not None and difference <= t.max_mean_abs_diff,
                          f"mean absolute difference {format_number(difference)} (at most {t.max_mean_abs_diff:g})"))
    else:
        ours_rate, theirs_rate = challenger["error_rate"] or 0.0, champion["error_rate"] or 0.0
        increase = (ours_rate - theirs_rate) * 100
        found.append((increase <= t.max_error_increase, f"error rate {format_share(ours_rate)} vs "
                      f"{format_share(theirs_rate)}: {increase:+.2f} points (at most +{t.max_error_increase:g}: "
                      "--max-error-increase)"))
    return found


def format_ms(value: float | None) -> str:
    """A latency as the report's histogram bounds it: "at most" a bucket's bound, or past the last one."""
    if value is None:
        return "-"
    return "> last bucket" if math.isinf(value) else f"<= {value:g} ms"


def format_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def format_share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"
