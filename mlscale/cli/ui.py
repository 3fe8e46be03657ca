"""``mlscale ui``: parse, check, start the read-only web app (``mlscale.ui``)."""

from __future__ import annotations

import argparse

from mlscale.cli.models import add_registry_option

UI_EXAMPLES = """examples:
  mlscale ui                                   # ./runs and ./mlscale-registry on http://127.0.0.1:8080
  mlscale ui --runs /shared/runs --registry postgresql://mlscale@db/registry --server http://10.0.0.5:8000
  MLSCALE_UI_TOKEN=$(openssl rand -hex 16) mlscale ui --host 0.0.0.0   # beyond loopback: a token is required

On a remote cluster keep the UI on loopback and forward the port:
  ssh -L 8080:127.0.0.1:8080 login-node mlscale ui --runs /shared/runs
  kubectl port-forward deploy/mlscale-ui 8080:8080
"""


def add_ui(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ui", help="a read-only web page of runs, ranks, failures, the registry and live servers",
        description="Serves one web page (nothing fetched from elsewhere) over run directories, the model "
        "registry and running servers: a table of runs; a run's loss, throughput, the per-rank split of each "
        "step, a straggler heat map, failures and recoveries on the timeline, memory, pipeline stages, config "
        "and plan, updated live while it trains; the registry's versions, stages, aliases, history and "
        "lineage; each server's goodput, latency, batches, queue, cache and skew from its own /metrics. "
        "Listens on loopback unless --host says otherwise, which needs a token.",
        epilog=UI_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        arguments="mlscale.cli.ui:add_ui_arguments")
    p.set_defaults(handler=_ui)


def add_ui_arguments(p: argparse.ArgumentParser) -> None:
    from mlscale.ui.app import TOKEN_ENV

    p.add_argument("--runs", metavar="DIR", default=None,
                   help="folder of run directories, searched 3 levels deep (default ./runs)")
    add_registry_option(p)
    p.add_argument("--server", metavar="URL", action="append", default=[], dest="servers",
                   help="a running `mlscale serve` to watch (its /metrics and statistics); repeat for several")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port)")
    p.add_argument("--token", default=None,
                   help=f"require this token of every request (default ${TOKEN_ENV}, which keeps it out of "
                   "the process list); required with a --host beyond loopback")
    p.add_argument("--slo-ms", type=float, default=100.0,
                   help="latency objective the serving page's goodput counts answers within (default 100)")


def _ui(args: argparse.Namespace) -> int:
    from mlscale.ui.server import run_ui, settings_from

    settings, host, port = settings_from(args.runs, args.registry, args.servers, args.host, args.port, args.token,
                                         args.slo_ms)
    return run_ui(settings, host, port)
