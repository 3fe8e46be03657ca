"""``mlscale serve``: parse the options, start the server."""

from __future__ import annotations

import argparse

from mlscale.cli_models import add_registry_option


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve registered models over HTTP (Open Inference Protocol v2)",
        description="Serves one or more registered models with dynamic batching, a response cache and "
        "backpressure. A URI with an alias or stage (models:/digits@production) is followed: when it moves, "
        "the new version is loaded in the background and swapped in without failing a request.",
        epilog="example: mlscale serve models:/digits@production --max-batch-size 64 --slo-ms 50")
    p.add_argument("uris", nargs="+", metavar="MODEL_URI")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=64, help="most rows per model call (default 64)")
    p.add_argument("--max-delay-ms", type=float, default=2.0,
                   help="longest a queued request waits for batch-mates (default 2); never on an idle server")
    p.add_argument("--slo-ms", type=float, default=None,
                   help="latency objective: adapts the batch size and refuses requests that would miss it")
    p.add_argument("--cache-mb", type=float, default=64.0, help="response cache size; 0 turns it off (default 64)")
    p.add_argument("--runtime", default="auto", choices=["auto", "onnx", "torch"],
                   help="auto: onnxruntime when the version has an ONNX export, else torch")
    p.add_argument("--queue-limit", type=int, default=256, help="queued requests per model before 503 (default 256)")
    p.add_argument("--timeout-ms", type=float, default=10_000, help="longest a request may wait in the queue")
    p.add_argument("--threads", type=int, default=1, help="threads per model execution (default 1)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies get 413 (default 8)")
    p.add_argument("--reload-interval-s", type=float, default=2.0,
                   help="how often aliases and stages are checked for a new version (default 2)")
    add_registry_option(p)
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from mlscale.errors import UsageError
    from mlscale.serve import ServeOptions, serve

    for name in ("max_batch_size", "queue_limit", "threads"):
        if getattr(args, name) < 1:
            raise UsageError(f"bad value {name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    for name in ("max_delay_ms", "cache_mb", "timeout_ms", "max_body_mb", "reload_interval_s"):
        if getattr(args, name) < 0:
            raise UsageError(f"bad value {name.replace('_', '-')}={getattr(args, name)}: must be >= 0")
    if args.slo_ms is not None and args.slo_ms <= 0:
        raise UsageError(f"bad value slo-ms={args.slo_ms}: must be > 0")
    if not 0 < args.port < 65536:
        raise UsageError(f"bad value port={args.port}: must be 1..65535")
    options = ServeOptions(max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms,
                           queue_limit=args.queue_limit, slo_ms=args.slo_ms, timeout_ms=args.timeout_ms,
                           runtime=args.runtime, threads=args.threads, cache_mb=args.cache_mb,
                           reload_interval_s=args.reload_interval_s)
    serve(args.uris, host=args.host, port=args.port, options=options, registry_location=args.registry,
          max_body_bytes=int(args.max_body_mb * 1024 * 1024))
    return 0
