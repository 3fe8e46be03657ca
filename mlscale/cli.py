"""The ``mlscale`` command: parses, calls the Python API, prints. No logic of its own.

Exit codes: 0 success, 2 bad usage or configuration (one line naming the bad value), 1 anything else.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

from mlscale.cli_features import add_features
from mlscale.cli_k8s import add_k8s
from mlscale.cli_models import add_export, add_models, add_registry_option
from mlscale.cli_parsers import LazyParser
from mlscale.cli_serve import add_serve
from mlscale.display import as_json
from mlscale.errors import MlscaleError, UsageError

EXAMPLES = """examples:
  mlscale train --task digits --workers 2 --epochs 5
  mlscale train --config run.toml --workers 4 --run-dir runs/big --checkpoint-every 100
  mlscale train --run-dir runs/big --resume
  mlscale train --task mypkg.tasks:make_task --task-opt width=512
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m mlscale train --config run.toml --run-dir /shared/runs/big
"""


def _task_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for convert in (int, float):
        try:
            return key, convert(raw)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(raw.lower(), raw)


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of workers or 'auto', got {text!r}") from None


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on one or more workers",
                       description="Train a task with a parallel strategy. Values from --config are "
                       "overridden by the flags given here.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="TOML or JSON file with any of the keys below")
    p.add_argument("--task", help="built-in task (digits, digits-cnn, synthetic, tinylm), a factory declared with "
                   "@mlscale.declare_task (package.module:factory) or an installed mlscale.tasks entry point")
    p.add_argument("--task-opt", action="append", type=_task_option, metavar="KEY=VALUE",
                   help="option passed to the task factory (repeatable), e.g. hidden=256")
    p.add_argument("--workers", type=int, help="processes (default 1): data-parallel replicas under ddp and fsdp, "
                   "ranks splitting one replica under tp, stages x replicas under pipeline, workers besides the "
                   "servers under ps")
    p.add_argument("--strategy", help="ddp (default: full replicas, gradients all-reduced), fsdp (parameters, "
                   "gradients and optimizer state sharded over the workers), tp (tensor parallel transformer "
                   "blocks), pipeline (the model's blocks split into stages) or ps (parameter server)")
    mp = p.add_argument_group("pipeline (--strategy pipeline)")
    mp.add_argument("--stages", type=int, metavar="P", help="stages the model's blocks are split into, balanced by "
                    "parameter count (default 2); --workers must be a multiple: workers / P data-parallel replicas")
    mp.add_argument("--microbatches", type=int, metavar="M",
                    help="microbatches each batch is cut into; must divide --batch-size (default 4). The idle "
                    "share of each stage, the bubble, is (P-1)/(M+P-1)")
    mp.add_argument("--schedule", help="1f1b (default: one forward, one backward; holds at most P microbatches' "
                    "activations) or gpipe (all forwards, then all backwards)")
    p.add_argument("--memory-limit-mb", type=float, metavar="MB",
                   help="cap every process's memory for training (model, gradients, optimizer state, activations) "
                   "at MB above what it holds when it starts; a process over it fails with a clear message. "
                   "Shows what fits on one device and what needs fsdp or pipeline. Every rank still builds the "
                   "whole model before fsdp shards it; on a CPU, checkpoints are then written in place")
    ps = p.add_argument_group("parameter server (--strategy ps)")
    ps.add_argument("--sync", help="bsp (default: every step waits for all workers), ssp (bounded staleness) or "
                    "async (every gradient applied as it arrives)")
    ps.add_argument("--staleness", type=int, metavar="S",
                    help="ssp: no worker runs more than S steps ahead of the slowest (default 3)")
    ps.add_argument("--ps-servers", type=int, metavar="S",
                    help="server processes holding the parameters, sharded by size (default 1); they come on top "
                    "of --workers")
    ps.add_argument("--backup-workers", type=int, metavar="B",
                    help="bsp: a step applies the first workers-B gradients and drops the late ones (default 0)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps to run")
    length.add_argument("--epochs", type=float, help="passes over the training data (default 10)")
    p.add_argument("--batch-size", type=int, help="samples per data-parallel replica per step (default 32): "
                   "a pipeline or tp replica of several processes still takes this many")
    p.add_argument("--grad-accum", type=int, metavar="K", help="gradient accumulation: K micro-steps of "
                   "--batch-size samples per optimizer step, gradients synchronised once, on the last (default 1); "
                   "trains like --batch-size x K. ddp, fsdp, tp")
    p.add_argument("--compress", help="ddp: none (default), fp16 or bf16 (gradients cast to 16 bits for the "
                   "all-reduce: half the bytes) or powersgd (rank-2 PowerSGD with error feedback after 10 plain "
                   "steps); bytes sent are in report.json communication")
    p.add_argument("--bucket-mb", type=float, metavar="MB", help="ddp: gradient bucket size of the all-reduce "
                   "(default 25, DDP's): smaller buckets start communicating earlier, larger ones send fewer messages")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model (ddp, in place: "
                   "weights and checkpoints unchanged); the first steps pay for compiling, report.json has the "
                   "step times with and without that (`compile`)")
    p.add_argument("--clip-grad-norm", type=float, metavar="X", help="clip the gradients' global L2 norm to X "
                   "before each update (after unscaling under fp16); ddp, fsdp")
    p.add_argument("--eval-every", type=int, metavar="N", help="held-out metrics every N steps, on the console and "
                   "in metrics.jsonl (`eval`); default: at the end only. ddp, fsdp, tp")
    p.add_argument("--lr", type=float, help="peak learning rate (default 0.05)")
    p.add_argument("--optimizer", help="sgd (default) or adam")
    p.add_argument("--seed", type=int, help="seed for weights, data order and every RNG (default 0)")
    p.add_argument("--dtype", help="float32 (default) or float64 for weights and data")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--precision", help="fp32 (default), bf16 or fp16: autocast for compute, the weights "
                           "stay fp32 (master weights); fp16 adds a dynamic loss scaler")
    precision.add_argument("--bf16", action="store_const", const="bf16", dest="precision",
                           help="the same as --precision bf16 (the Hugging Face Trainer's flag)")
    precision.add_argument("--fp16", action="store_const", const="fp16", dest="precision",
                           help="the same as --precision fp16 (the Hugging Face Trainer's flag)")
    p.add_argument("--device", help="auto (default: cuda if available), cpu or cuda")
    p.add_argument("--run-dir", metavar="DIR", help="where config, metrics, checkpoints and report go")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="checkpoint every K steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=int, metavar="K", help="keep the newest K checkpoints (default 3)")
    p.add_argument("--no-async-checkpoint", action="store_false", dest="async_checkpoint", default=None,
                   help="write checkpoints on the training thread (default: on a background thread)")
    p.add_argument("--max-restarts", type=int, metavar="R",
                   help="restart the worker group up to R times after a failure, resuming from the newest "
                   "checkpoint (per-step: restart a failed replica group's worker up to R times)")
    tolerance = p.add_argument_group("fault tolerance")
    tolerance.add_argument("--fault-tolerance", choices=["restart", "per-step"], help="restart (default): a failed "
                           "worker stops the job, every worker restarts from the newest checkpoint. per-step (ddp, or "
                           "fsdp as HSDP; torchft): every worker is a replica group, the healthy ones go on without "
                           "the failed one, and its replacement (--max-restarts per group) receives the current state "
                           "from a live peer")
    tolerance.add_argument("--lighthouse", metavar="ADDR", help="per-step: the torchft lighthouse to join, e.g. "
                           "http://host:29510 (across hosts: run torchft_lighthouse, one torchrun per host with its "
                           "REPLICA_GROUP_ID); default: mlscale starts one for the job")
    tolerance.add_argument("--min-replicas", type=int, metavar="N", help="per-step: the fewest replica groups that "
                           "may commit a step (default 1)")
    tolerance.add_argument("--group-size", type=int, metavar="P", help="per-step: processes per replica group "
                           "(default 1); with --strategy fsdp the model is sharded over each group's P processes and "
                           "the groups replicate it (HSDP); --workers counts the groups")
    tolerance.add_argument("--heartbeat-timeout-ms", type=int, metavar="MS", help="per-step: how long the lighthouse "
                           "mlscale starts waits for a silent replica group before leaving it out of the quorum "
                           "(default 1000): shorter finds failures sooner, too short drops a busy one")
    p.add_argument("--collective-timeout", type=float, metavar="S", dest="collective_timeout_s",
                   help="seconds a collective may wait for a peer before the job treats it as hung (default 300)")
    p.add_argument("--fault", action="append", metavar="SPEC", dest="faults",
                   help="inject a failure (repeatable): kill:rank=R:step=K (before step K), kill_in_step:rank=R:step=K "
                   "(in the middle of it; per-step: add :rejoin_by=J and the others wait before step J, at most "
                   "--collective-timeout, until R's replacement is up), hang:rank=R:step=K, "
                   "slow:rank=R:delay_ms=D (add :p=P to be slow on a fraction P of steps; rank=any: a random "
                   "worker each step), kill_during_checkpoint:step=K")
    p.add_argument("--straggler-threshold", type=float, metavar="X",
                   help="flag a rank whose compute + data wait is X times the fastest rank's (default 1.5)")
    p.add_argument("--simulated-compute-ms", type=float, metavar="MS",
                   help="add MS of simulated compute to every step: benchmarks of the algorithms on few cores")
    featured = p.add_argument_group("training from features")
    featured.add_argument("--features", metavar="MODULE:SERVICE", help="train on this feature service's "
                          "point-in-time training set (a declared feature repository module and a service in it; "
                          "sets --task features)")
    featured.add_argument("--entities", metavar="FILE", help="the entity rows: a Parquet file with the join keys, "
                          "an event_timestamp and the label")
    featured.add_argument("--label", metavar="COLUMN", help="the entity rows' label column (default label)")
    data = p.add_argument_group("input pipeline")
    data.add_argument("--data-workers", type=_workers, metavar="N|auto", help="DataLoader worker processes that "
                      "load (and transform) batches ahead of training (default 0: in the training process); auto: "
                      "measures 0, 1, 2, 4... and says what it picked. The batches and the resume position are "
                      "the same with any number")
    data.add_argument("--data-prefetch", type=int, metavar="B", help="batches each data worker prepares ahead "
                      "(default 2)")
    data.add_argument("--data-cache", nargs="?", const="memory", choices=["none", "memory", "disk"],
                      help="keep samples as the epochs make them (transformed; for Parquet data also decoded), so "
                      "that later epochs skip that work: memory (shared memory; the default when the flag is given "
                      "alone) or disk (files in RUN_DIR/data-cache, for data larger than memory, found again by a "
                      "resumed run)")
    p.add_argument("--log-every", type=int, metavar="K", help="metrics line every K steps (default 10)")
    p.add_argument("--log", action="append", metavar="SINK", choices=["tensorboard"],
                   help="also write the metrics to SINK: tensorboard (event files in RUN_DIR/tensorboard; needs "
                   "mlscale[tensorboard]; view with `tensorboard --logdir RUN_DIR`)")
    p.add_argument("--register", metavar="NAME", help="register the final model under NAME when training ends")
    p.add_argument("--json", action="store_true", help="print report.json instead of the summary table")
    p.add_argument("--check", action="store_true", help="check the configuration and the data for a job of "
                   "--workers processes ($WORLD_SIZE when set, as torchrun sets it), train nothing: exit 0, or 2 "
                   "naming what is wrong (what a Kubernetes Job's check container runs)")
    p.add_argument("--no-progress", action="store_false", dest="progress", default=None,
                   help="no progress bar or progress lines (failures and restarts are still reported)")
    p.add_argument("--no-plot", action="store_false", dest="plot",
                   help="do not draw RUN_DIR/plots/training.png at the end (drawn when matplotlib is installed)")
    add_registry_option(p)
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    overrides = {key: getattr(args, key) for key in (
        "task", "workers", "strategy", "steps", "epochs", "batch_size", "lr", "optimizer", "seed", "dtype",
        "precision", "device", "run_dir", "resume", "checkpoint_every", "keep_checkpoints", "async_checkpoint",
        "max_restarts", "collective_timeout_s", "faults", "log_every", "sync", "staleness", "ps_servers",
        "backup_workers", "straggler_threshold", "simulated_compute_ms", "progress", "stages", "microbatches",
        "schedule", "memory_limit_mb", "grad_accum", "compress", "bucket_mb", "clip_grad_norm", "eval_every", "log",
        "compile", "data_workers", "data_prefetch", "data_cache", "fault_tolerance", "lighthouse", "min_replicas",
        "heartbeat_timeout_ms", "group_size")}
    if args.task_opt:
        overrides["task_options"] = dict(args.task_opt)
    if args.features or args.entities:  # the features task, with the retrieval's inputs as its options
        featured = {"service": args.features, "entities": args.entities, "label": args.label}
        overrides["task"] = "features"
        overrides["task_options"] = {**overrides.get("task_options", {}),
                                     **{k: v for k, v in featured.items() if v is not None}}
    config = build_config(args.config, **overrides)
    if args.check:
        from mlscale.train.launcher import check_only

        print(check_only(config))
        return 0
    if args.register:  # the name is checked before training, not after it
        from mlscale.registry.uri import check_name

        check_name(args.register)
    report = fit(config, keep_group=True)  # `run` leaves the process without tearing the group down
    if not report:  # not rank 0 under torchrun: rank 0 reports (and registers)
        return 0
    if args.register:  # opened (created if new) only now: a refused job leaves no registry behind
        from mlscale.registry import Registry, register_run

        report["model_uri"] = register_run(Registry(args.registry), report["run_dir"], args.register).uri
    if args.plot:
        report["plot"] = _plot(report["run_dir"])
    if args.json:
        print(as_json(report))
    else:
        print_train_summary(report)
    return 0


def _plot(run_dir: str) -> str | None:
    """``RUN_DIR/plots/training.png``, when matplotlib (the ``bench`` extra) is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    from mlscale.train.plot import plot_run

    return str(plot_run(run_dir))


def print_train_summary(report: dict[str, Any]) -> None:
    eval_text = ", ".join(f"{k} {v:.4f}" for k, v in report["eval"].items())
    workers, world = report.get("workers", report["world_size"]), report["world_size"]
    if report.get("parameter_server"):
        layout = f"{workers} worker(s) + {world - workers} server(s)"
    elif workers != world:  # a replica spans several processes
        layout = f"{world} processes, {workers} data-parallel replica(s)"
    else:
        layout = f"{workers} worker(s)"
    rows = [
        ("task", f"{report['task']} ({report['strategy']}, {layout})"),
        ("steps", f"{report['steps']} ({report['samples_seen']:,} samples)"),
        ("final loss", f"{report['final_loss']:.4f}"),
        ("eval", eval_text),
        ("throughput", f"{report['samples_per_s']:,.0f} samples/s"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("run dir", report["run_dir"]),
    ]
    if report.get("stragglers"):
        flagged = report["straggler_detection"]["flagged"]
        rows.append(("stragglers", ", ".join(f"rank {r} (from step {f['first_step']}, up to {f['max_score']:.1f}x)"
                                             for r, f in flagged.items())))
    server = report.get("parameter_server")
    if server:
        rows.append(("parameter server", f"{server['sync']}, {server['gradients_applied']:,} gradients applied, "
                     f"{server['gradients_dropped']:,} dropped, staleness max {server['staleness']['max']}"))
    pipeline = report.get("pipeline")
    if pipeline:
        rows.append(("pipeline", f"{pipeline['stages']} stages, {pipeline['microbatches']} microbatches, "
                     f"{pipeline['schedule']}: {pipeline['split']}"))
    tolerance = report.get("fault_tolerance")
    if tolerance:
        recovery = report["recovery"]
        live = recovery["live_recoveries"]
        rejoin = ", ".join(f"group {e['replica']} at step {e['step']}" for e in live)
        rows.append(("fault tolerance", f"per-step ({tolerance['engine']}), {tolerance['replicas']} replica groups: "
                     f"{recovery['steps_without_every_replica']} step(s) without every group, "
                     f"{recovery['samples_not_trained']:,} samples not trained, {len(live)} live recovery(ies)"
                     + (f" ({rejoin})" if rejoin else "")))
    memory = report.get("memory")
    if memory:
        rows.append(("memory", ", ".join(f"rank {m['rank']} {m['state_mb']:.1f} MB" for m in memory[:8])
                     + (" ..." if len(memory) > 8 else "") + " of state (parameters, gradients, optimizer)"))
    if report.get("model_uri"):
        rows.append(("registered", report["model_uri"]))
    if report.get("plot"):
        rows.append(("plot", report["plot"]))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


# name -> (module with add_arguments and run_from_args, help)
BENCHMARKS = {
    "train": ("mlscale.bench.train", "our trainer vs a plain hand-written DDP loop"),
    "model-parallel": ("mlscale.bench.model_parallel", "pipeline bubble vs (P-1)/(M+P-1); memory per rank, "
                       "ddp vs fsdp vs pipeline"),
    "data": ("mlscale.bench.data", "input pipeline: data wait and samples/s, naive vs workers vs cache"),
    "checkpoint": ("mlscale.bench.checkpoint", "training stall of checkpointing, blocking vs async"),
    "recovery": ("mlscale.bench.recovery", "one failure: restart-all vs per-step fault tolerance (torchft)"),
    "export": ("mlscale.bench.export", "inference latency, onnxruntime vs eager torch, digits models"),
    "serve": ("mlscale.bench.serve", "serving goodput at an SLO vs LitServe, FastAPI and offline"),
    "features": ("mlscale.bench.features", "point-in-time retrieval vs pandas merge_asof; SQLite and Redis lookups"),
    "hostile": ("mlscale.bench.hostile", "a normal client's p99 and the server's memory under slow, idle and "
                "flooding clients"),
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against the anchors (JSON + PNG)")
    bench_sub = p.add_subparsers(dest="what", required=True, parser_class=LazyParser)
    for name, (module, text) in BENCHMARKS.items():  # each imports its module only when it is run
        bench = bench_sub.add_parser(name, help=text, arguments=f"{module}:add_arguments")
        bench.set_defaults(handler=lambda args, module=module: _bench(module, args))


def _bench(module: str, args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(module).run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mlscale import __version__

    parser = LazyParser(prog="mlscale", description="Scale a PyTorch model from one worker to many, then serve it.",
                        epilog="Exit codes: 0 success, 2 bad usage (one line naming the value), 1 anything else.")
    parser.add_argument("--version", action="version", version=f"mlscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    _add_train(sub)
    add_models(sub)
    add_export(sub)
    add_serve(sub)
    add_features(sub)
    add_k8s(sub)
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
        from mlscale.redact import redact_text

        print(redact_text(traceback.format_exc()), end="", file=sys.stderr)  # a URL in it keeps no password
        code = 1
    if "mlscale.train.dist" in sys.modules and sys.modules["mlscale.train.dist"].owns_process_group():
        from mlscale.train.worker import leave

        leave(code)
    sys.exit(code)


def _redacted(exc: BaseException) -> str:
    from mlscale.redact import redact_text

    return redact_text(str(exc))


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
        from mlscale.redact import redact_text

        parser.exit(2, f"{prog}: error: unrecognized arguments: {redact_text(' '.join(unknown))} "
                    f"(see {prog} --help)\n")
    try:
        return args.handler(args)
    except UsageError as exc:  # every URL in a message is printed without its password
        print(f"mlscale: error: {_redacted(exc)}", file=sys.stderr)
        return exc.exit_code
    except MlscaleError as exc:
        print(f"mlscale: {_redacted(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("mlscale: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    run()
