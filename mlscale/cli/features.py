"""``mlscale features skew``: the training-serving skew of a served model, a table and an exit code
that can gate a pipeline (1 past a threshold)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from mlscale.cli.models import add_registry_option
from mlscale.errors import UsageError

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


def _duration(text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 6h or 2d")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def add_features(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("features", help="feature stores: training-serving skew")
    fsub = p.add_subparsers(dest="action", required=True)
    skew = fsub.add_parser("skew", help="how far served features are from the training distribution",
                           description="Compares the feature vectors a server logged (mlscale serve --feature-log) "
                           "for a model version with the statistics of its training set (in the registry): "
                           "Jensen-Shannon divergence for numeric features, L-infinity for categorical ones. "
                           "Exits 1 when a feature is past its threshold, so it can gate a pipeline.",
                           epilog="example: mlscale features skew models:/churn/1 --log feature-log.db --since 6h")
    skew.add_argument("uri", metavar="MODEL_URI")
    skew.add_argument("--log", required=True, metavar="FILE", help="the server's --feature-log file")
    skew.add_argument("--since", type=_duration, metavar="DURATION", help="only vectors served in the last "
                      "DURATION (30m, 6h, 2d; default: all)")
    skew.add_argument("--threshold", type=float, default=None, help="one threshold for every feature (default: each "
                      "feature's skew_threshold, else 0.1)")
    skew.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_registry_option(skew)
    skew.set_defaults(handler=_skew)


def _skew(args: argparse.Namespace) -> int:
    from mlscale.features.skew import FeatureLog, FeatureSkew
    from mlscale.registry import Registry

    version = Registry(args.registry, create=False).resolve(args.uri)
    trained = version.metrics.get("features")
    if not trained:
        raise UsageError(f"{version.uri} was not trained from features: it has no training statistics to compare")
    if not Path(args.log).exists():
        raise UsageError(f"bad value log={args.log!r}: no such file (the server writes it with --feature-log)")
    since = time.time() - args.since if args.since else 0.0
    served = FeatureLog(args.log).columns(version.name, version.version, trained["features"], since)
    thresholds = {} if args.threshold is None else {name: args.threshold for name in trained["features"]}
    skew = FeatureSkew(trained["statistics"], thresholds=thresholds)
    skew.observe(served)
    rows = skew.report()
    if args.json:
        print(json.dumps({"model_uri": version.uri, "samples": skew.seen, "features": rows}, indent=2))
    else:
        print(f"{version.uri}: {skew.seen:,} served vectors" + (f" in the last {args.since:g} s" if args.since else ""))
        print(f"{'feature':<24} {'measure':<16} {'distance':>9} {'threshold':>9}  status")
        for row in rows:
            status = "too few samples" if row["skewed"] is None else "SKEWED" if row["skewed"] else "ok"
            print(f"{row['feature']:<24} {row['measure']:<16} {row['distance']:>9.4f} {row['threshold']:>9.3f}  "
                  f"{status}")
    if any(row["skewed"] for row in rows):
        print("mlscale: training-serving skew past the threshold", file=sys.stderr)
        return 1
    return 0
