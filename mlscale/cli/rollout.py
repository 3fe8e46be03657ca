"""``mlscale models canary`` (move a canary's share) and ``mlscale models compare`` (judge a challenger
from a running server's figures; exit 1 past a threshold, so a CI step can gate a promotion).

The gate itself (the server's report, the checks) is ``mlscale.serve.promotion``, imported when the
command runs so that ``mlscale --help`` loads nothing of the server; this module parses and prints."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from mlscale.common.display import as_json, table

if TYPE_CHECKING:
    from mlscale.serve.promotion import Thresholds

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


def _thresholds(args: argparse.Namespace) -> Thresholds:
    """Each flag is the threshold of its name (--min-requests is ``min_requests``)."""
    from mlscale.serve.promotion import Thresholds

    return Thresholds(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Thresholds)})


def _compare(args: argparse.Namespace) -> int:
    from mlscale.serve.promotion import fetch_comparison, judge

    report = fetch_comparison(args.server, args.name)
    verdict = judge(report, args.name, args.challenger, _thresholds(args), args.server)
    champion, challenger = verdict.champion, verdict.challenger
    if args.json:
        print(as_json({"champion": champion, "challenger": challenger,
                       "checks": [{"passed": ok, "check": what} for ok, what in verdict.checks]}))
    else:
        _print_side_by_side(champion, challenger)
        for ok, what in verdict.checks:
            print(f"  {'ok  ' if ok else 'FAIL'}  {what}")
        print(f"{args.name} v{challenger['version']}: " + ("every check passed" if verdict.passed
                                                         else "NOT ready to promote"))
    return 0 if verdict.passed else 1


def _print_side_by_side(champion: dict[str, Any], challenger: dict[str, Any]) -> None:
    from mlscale.serve.promotion import format_ms, format_number, format_share

    heads = ["", f"v{champion['version']} (served)", f"v{challenger['version']} ({challenger['role']})"]
    lines = [("uri", champion["uri"], challenger["uri"]),
             ("share asked", f"{champion['share_percent']:g}%", f"{challenger['share_percent']:g}%"),
             ("routed by name", champion["routed"], challenger["routed"]),
             ("answered", champion["success"], challenger["success"]),
             ("error rate", format_share(champion["error_rate"]), format_share(challenger["error_rate"])),
             ("client errors (not judged)", champion.get("client_errors", 0), challenger.get("client_errors", 0)),
             ("p50", format_ms(champion["p50_ms"]), format_ms(challenger["p50_ms"])),
             ("p99", format_ms(champion["p99_ms"]), format_ms(challenger["p99_ms"]))]
    shadow = challenger.get("shadow")
    if shadow:
        lines = [line for line in lines if line[0] not in ("share asked", "routed by name")]
        lines += [("copies sent / skipped", "", f"{shadow['sent']} / {shadow['skipped']}"),
                  ("compared", "", shadow["compared"]), ("agreement", "", format_share(shadow["agreement"])),
                  ("mean abs difference", "", format_number(shadow["mean_abs_diff"])),
                  ("p99 on the same requests", format_ms(shadow["served_p99_ms"]), format_ms(shadow["p99_ms"]))]
    print(table(heads, lines))
