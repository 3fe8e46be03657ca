"""The ``mlscale`` command: parses, calls the Python API, prints. No logic of its own.

Exit codes: 0 success, 2 bad usage or configuration (one line naming the bad value), 1 anything else.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from mlscale import __version__
from mlscale.cli.features import add_features
from mlscale.cli.k8s import add_k8s
from mlscale.cli.models import add_export, add_models
from mlscale.cli.parsers import LazyParser
from mlscale.cli.plan import add_plan
from mlscale.cli.serve import add_serve
from mlscale.cli.ui import add_ui
from mlscale.common.redact import redact_text
from mlscale.errors import MlscaleError, report_error

TRAIN_EXAMPLES = """examples:
  mlscale train --task digits --workers 2 --epochs 5
  mlscale train --config run.toml --workers 4 --run-dir runs/big --checkpoint-every 100
  mlscale train --run-dir runs/big --resume
  mlscale train --task mypkg.tasks:make_task --task-opt width=512
  mlscale train --task tinylm --strategy pipeline --workers 4 --stages 2 --microbatches 8
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m mlscale train --config run.toml --run-dir /shared/runs/big
"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on one or more workers",
                       epilog=TRAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       # the flags are built from a table only when `train` runs (mlscale.cli.train)
                       arguments="mlscale.cli.train:add_train_arguments")
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from mlscale.cli.train import run_train

    return run_train(args)


# name -> (module with add_arguments and run_from_args, help)
BENCHMARKS = {
    "train": ("mlscale.bench.train", "our trainer vs a plain hand-written DDP loop"),
    "model-parallel": ("mlscale.bench.model_parallel", "pipeline bubble vs (P-1)/(M+P-1); memory per rank, "
                       "ddp vs fsdp vs pipeline"),
    "data": ("mlscale.bench.data", "input pipeline: data wait, naive vs workers vs cache; a user's Dataset's "
             "batches/s, mlscale's loaders vs a plain DataLoader; a mid-epoch resume's time to first step vs fresh"),
    "checkpoint": ("mlscale.bench.checkpoint", "training stall of checkpointing, blocking vs async"),
    "recovery": ("mlscale.bench.recovery", "one failure: restart-all vs per-step fault tolerance (torchft)"),
    "startup": ("mlscale.bench.startup", "workers started cold vs warm (forked by a zygote): time to the first "
                "step and a restart's downtime"),
    "export": ("mlscale.bench.export", "inference latency, onnxruntime vs eager torch, digits models"),
    "serve": ("mlscale.bench.serve", "serving goodput at an SLO vs LitServe, FastAPI and offline"),
    "serve-scale": ("mlscale.bench.serve_scale", "serving goodput by workers per host vs LitServe; a shadow's "
                    "cost to p99; a canary's split"),
    "serve-lengths": ("mlscale.bench.serve_lengths", "requests of different sequence lengths (BERT): padded to the "
                      "batch's longest vs grouped by length vs no batching"),
    "generate": ("mlscale.bench.generate", "text generation under Poisson load (TTFT, TPOT, ITL, goodput): "
                 "continuous batching vs static batching, generate alone and transformers' continuous batching; "
                 "prefix caching's TTFT"),
    "features": ("mlscale.bench.features", "point-in-time retrieval vs pandas merge_asof; SQLite and Redis lookups"),
    "ui": ("mlscale.bench.ui", "mlscale ui's page load for a run of 100,000 steps on 64 ranks, cold and warm"),
    "hostile": ("mlscale.bench.hostile_bench", "a normal client's p99 and the server's memory under slow, idle and "
                "flooding clients, and of mlscale ui and the supervisor under planted files, hostile scraped servers "
                "and signals"),
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against the anchors (JSON + PNG)")
    bench_sub = p.add_subparsers(dest="what", required=True, parser_class=LazyParser)
    for name, (module, text) in BENCHMARKS.items():  # each imports its module only when it is run
        bench = bench_sub.add_parser(name, help=text, arguments=f"{module}:add_arguments")
        bench.set_defaults(handler=lambda args, module=module: _bench(module, args))


def _bench(module: str, args: argparse.Namespace) -> int:
    importlib.import_module(module).run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = LazyParser(prog="mlscale", description="Scale a PyTorch model from one worker to many, then serve it.",
                        epilog="Exit codes: 0 success, 2 bad usage (one line naming the value), 1 anything else.")
    parser.add_argument("--version", action="version", version=f"mlscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    _add_train(sub)
    add_plan(sub)
    add_models(sub)
    add_export(sub)
    add_serve(sub)
    add_features(sub)
    add_k8s(sub)
    add_ui(sub)
    _add_bench(sub)
    return parser


def run() -> None:
    """The ``mlscale`` command (and ``python -m mlscale``): ``main``, then the exit.

    A process still in the process group mlscale made (``mlscale train`` under torchrun) exits without
    interpreter teardown: a gloo group's destructors can abort (SIGABRT), turning a finished run into a
    failed worker. An error nothing else caught is printed first, and is exit 1."""
    try:
        code = main()
    except SystemExit as exc:  # argparse, --help, --version
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        print(redact_text(traceback.format_exc()), end="", file=sys.stderr)  # a URL in it keeps no password
        code = 1
    if "mlscale.train.dist" in sys.modules and sys.modules["mlscale.train.dist"].owns_process_group():
        from mlscale.train.worker import leave

        leave(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command; returns its exit code (never exits the process)."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    passed_on: list[str] | None = None
    if "--" in args_list:  # what follows is for another program (mlscale k8s serve -- SERVE FLAGS)
        at = args_list.index("--")
        args_list, passed_on = args_list[:at], args_list[at + 1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(args_list)
    if passed_on is not None:
        if hasattr(args, "passed_on"):
            args.passed_on = passed_on
        else:
            unknown += ["--", *passed_on]
    if unknown:  # named by the sub-command they were given to, as argparse would inside it
        words = [getattr(args, key, None) for key in ("command", "action", "what")]
        prog = " ".join(["mlscale", *(word for word in words if word)])

        parser.exit(2, f"{prog}: error: unrecognized arguments: {redact_text(' '.join(unknown))} "
                    f"(see {prog} --help)\n")
    try:
        return args.handler(args)
    except MlscaleError as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        print("mlscale: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        sys.stderr.close()
        return 0

