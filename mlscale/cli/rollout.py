"""``mlscale models canary`` (move a canary's share) and ``mlscale models compare`` (judge a challenger
from a running server's figures; exit 1 past a threshold, so a CI step can gate a promotion)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from typing import Any

from mlscale.display import as_json, table
from mlscale.errors import MlscaleError, UsageError

COMPARE_DESCRIPTION = """Compares a challenger version with the version a running `mlscale serve` serves
(the champion), from the server's own figures for the whole server (GET /v2/models/NAME/compare): a
canary (--canary) by its answered requests, error rate and latency beside the champion's, both of the
requests the traffic split routed (requests naming a version are not judged, nor are client errors,
4xx, which are counted apart); a shadow (--shadow) by how often its answers agree with the served ones,
their mean absolute difference and its latency. Prints both side by side, then each check; exits 1
when one fails (or there are too few requests to judge), 0 when all pass: a step a pipeline can gate a
promotion on. Latencies are histogram bucket bounds (the p99 is "at most" that), as Prometheus would
estimate them."""

COMPARE_EXAMPLES = """examples:
  mlscale models compare digits challenger --server http://127.0.0.1:8000
  mlscale models compare digits 2 --server http://digits:8000 --min-agreement 0.995 --max-p99-ratio 1.2
"""


def _percent(text: str) -> float:
    """The share, by the rule every server reads the tag with (a finite number in [0, 100])."""
    from mlscale.serve.share import canary_share

    try:
        return canary_share(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a percentage is a number between 0 and 100") from None


def add_rollout_commands(msub: argparse._SubParsersAction, common: Any) -> None:
    canary = common(msub.add_parser(
        "canary", help="set the share of a model's requests its canary takes (servers follow it)",
        description="Sets the model tag mlscale.canary_percent, which every `mlscale serve ... --canary` of "
        "this model reads as it reads aliases: the share moves without a restart. 0 stops the canary's "
        "traffic, 100 sends it all.", epilog="example: mlscale models canary digits 25"))
    canary.add_argument("name")
    canary.add_argument("percent", type=_percent)
    canary.set_defaults(handler=_canary)
    compare = msub.add_parser("compare", help="judge a challenger (canary or shadow) against the served version "
                              "from a running server; exit 1 past a threshold", description=COMPARE_DESCRIPTION,
                              epilog=COMPARE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("name", help="the model's name")
    compare.add_argument("challenger", help="its version number or an alias (the one the server's --canary or "
                         "--shadow names)")
    compare.add_argument("--server", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    compare.add_argument("--min-requests", type=int, default=100,
                         help="answers the challenger must have given to be judged (default 100)")
    compare.add_argument("--max-error-increase", type=float, default=1.0, metavar="POINTS",
                         help="canary: its error rate may exceed the champion's by this many points (default 1)")
    compare.add_argument("--max-p99-ratio", type=float, default=1.5,
                         help="its p99 latency over the champion's, at most (default 1.5)...")
    compare.add_argument("--min-latency-answers", type=int, default=1000,
                         help="answers each side needs before its p99 is judged (a p99 of fewer is a few slowest "
                         "requests: reported, not judged; default 1000)")
    compare.add_argument("--p99-slack-ms", type=float, default=5.0,
                         help="...or at most this much above it: differences of a few milliseconds between "
                         "histogram buckets are not judged (default 5)")
    compare.add_argument("--min-agreement", type=float, default=0.99,
                         help="shadow: the share of answers that agree with the served ones, at least (default 0.99)")
    compare.add_argument("--max-mean-abs-diff", type=float, default=None,
                         help="shadow: mean absolute difference of the answers, at most (default: not checked)")
    compare.add_argument("--json", action="store_true", help="print the figures and checks as JSON")
    compare.set_defaults(handler=_compare)


def _canary(args: argparse.Namespace) -> int:
    from mlscale.registry import Registry
    from mlscale.serve.share import SHARE_TAG

    Registry(args.registry, create=False).set_tag(args.name, None, SHARE_TAG, f"{args.percent:g}")
    print(as_json({SHARE_TAG: args.percent}) if args.json else
          f"{args.name}: its canary takes {args.percent:g}% of requests (servers follow within their reload interval)")
    return 0


def fetch_comparison(server: str, name: str) -> dict[str, Any]:
    """The server's comparison report; one line (never a traceback) when the server cannot be reached or
    fails (exit 1), refuses (4xx, its error: exit 2) or answers something that is not a report (exit 2:
    --server names something other than an `mlscale serve`)."""
    import urllib.error
    import urllib.request

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


def _is(row: dict[str, Any], wanted: str) -> bool:
    return wanted == row["version"] or wanted in row["aliases"] or row["uri"].endswith(f"@{wanted}")


def checks(champion: dict[str, Any], challenger: dict[str, Any], args: argparse.Namespace) -> list[tuple[bool, str]]:
    """(passed, what) of every check that applies to the challenger's role."""
    found: list[tuple[bool, str]] = []
    shadow = challenger.get("shadow")
    answered = shadow["compared"] if shadow else challenger["success"] + challenger["failed"]
    found.append((answered >= args.min_requests, f"{answered} answers to judge (at least {args.min_requests}: "
                  "--min-requests)"))
    ours, theirs = (shadow["p99_ms"], shadow["served_p99_ms"]) if shadow else (challenger["p99_ms"], champion["p99_ms"])
    fewest = answered if shadow else min(answered, champion["success"] + champion["failed"])
    if ours is not None and theirs and fewest < args.min_latency_answers:
        found.append((True, f"p99 {_ms(ours)} vs {_ms(theirs)}: not judged, {fewest} answers (at least "
                      f"{args.min_latency_answers}: --min-latency-answers)"))
    elif ours is not None and theirs:
        ratio = ours / theirs
        passed = ratio <= args.max_p99_ratio or ours <= theirs + args.p99_slack_ms
        found.append((passed, f"p99 {_ms(ours)} vs {_ms(theirs)}: x{ratio:.2f} (at most x{args.max_p99_ratio:g}, "
                      f"or {args.p99_slack_ms:g} ms more: --max-p99-ratio, --p99-slack-ms)"))
    if shadow:
        agreement = shadow["agreement"]
        found.append((agreement is not None and agreement >= args.min_agreement,
                      f"agreement {_share(agreement)} (at least {args.min_agreement:.2%}: --min-agreement)"))
        if args.max_mean_abs_diff is not None:
            difference = shadow["mean_abs_diff"]
            found.append((difference is not None and difference <= args.max_mean_abs_diff,
                          f"mean absolute difference {_number(difference)} (at most {args.max_mean_abs_diff:g})"))
    else:
        ours_rate, theirs_rate = challenger["error_rate"] or 0.0, champion["error_rate"] or 0.0
        increase = (ours_rate - theirs_rate) * 100
        found.append((increase <= args.max_error_increase, f"error rate {_share(ours_rate)} vs {_share(theirs_rate)}: "
                      f"{increase:+.2f} points (at most +{args.max_error_increase:g}: --max-error-increase)"))
    return found


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return "> last bucket" if math.isinf(value) else f"<= {value:g} ms"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def _compare(args: argparse.Namespace) -> int:
    report = fetch_comparison(args.server, args.name)
    rows = report["versions"]
    champion = next((row for row in rows if row["role"] == "primary"), None)
    challenger = next((row for row in rows if row["role"] != "primary" and _is(row, args.challenger)), None)
    if champion is None or challenger is None:
        held = ", ".join(f"v{row['version']} ({row['role']}, {row['uri']})" for row in rows)
        raise UsageError(f"the server at {args.server} holds no canary or shadow {args.challenger!r} of {args.name} "
                         f"(it holds {held}); start it with --canary or --shadow")
    results = checks(champion, challenger, args)
    if args.json:
        print(as_json({"champion": champion, "challenger": challenger,
                       "checks": [{"passed": ok, "check": what} for ok, what in results]}))
    else:
        _print_side_by_side(champion, challenger)
        for ok, what in results:
            print(f"  {'ok  ' if ok else 'FAIL'}  {what}")
        print(f"{args.name} v{challenger['version']}: " + ("every check passed" if all(ok for ok, _ in results)
                                                         else "NOT ready to promote"))
    return 0 if all(ok for ok, _ in results) else 1


def _print_side_by_side(champion: dict[str, Any], challenger: dict[str, Any]) -> None:
    heads = ["", f"v{champion['version']} (served)", f"v{challenger['version']} ({challenger['role']})"]
    lines = [("uri", champion["uri"], challenger["uri"]),
             ("share asked", f"{champion['share_percent']:g}%", f"{challenger['share_percent']:g}%"),
             ("routed by name", champion["routed"], challenger["routed"]),
             ("answered", champion["success"], challenger["success"]),
             ("error rate", _share(champion["error_rate"]), _share(challenger["error_rate"])),
             ("client errors (not judged)", champion.get("client_errors", 0), challenger.get("client_errors", 0)),
             ("p50", _ms(champion["p50_ms"]), _ms(challenger["p50_ms"])),
             ("p99", _ms(champion["p99_ms"]), _ms(challenger["p99_ms"]))]
    shadow = challenger.get("shadow")
    if shadow:
        lines = [line for line in lines if line[0] not in ("share asked", "routed by name")]
        lines += [("copies sent / skipped", "", f"{shadow['sent']} / {shadow['skipped']}"),
                  ("compared", "", shadow["compared"]), ("agreement", "", _share(shadow["agreement"])),
                  ("mean abs difference", "", _number(shadow["mean_abs_diff"])),
                  ("p99 on the same requests", _ms(shadow["served_p99_ms"]), _ms(shadow["p99_ms"]))]
    print(table(heads, lines))
