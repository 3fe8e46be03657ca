"""``mlscale plan``: what every rank will hold, per strategy and degree, before a job runs.

Know before you run: for every layout a job of --workers processes allows (ddp; fsdp over N; tp over T
when the model has a tensor-parallel plan; fsdp x tp; pipeline over P stages when it has repeated
blocks), the bytes one rank holds of parameters, gradients, optimizer state and activations (for
--batch-size, without and with activation checkpointing), the same quantities a run writes to
report.json's `memory`. They are found by running one step of the task's own model on fake tensors
(FakeTensorMode) over a fake process group, with the same fully_shard / parallelize_module calls and
the same optimizer as `mlscale train`: no weight is allocated, so a model of any size is planned on a
laptop in seconds. --memory-limit-mb M marks what fits on a device of M MB.

The options are `mlscale train`'s (declared once in mlscale.config), so the command that plans a job and
the one that runs it take the same words; `--config FILE` reads a run's configuration file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mlscale.common.display import as_json, table

PLAN_EXAMPLES = """examples:
  mlscale plan --task tinylm --batch-size 32
  mlscale plan --task tests.user_models:llama --workers 8 --batch-size 16 --memory-limit-mb 80 --json
  mlscale plan --task mypkg.tasks:make_task --task-opt width=4096 --optimizer adam --precision bf16 \\
      --strategy fsdp,pipeline --memory-limit-mb 80000
  mlscale plan --config run.toml --workers 4

Each row is one rank (rank 0: under fsdp the largest shard; a pipeline's largest stage); the JSON output
(--json) has every pipeline stage. What is not counted: communication buffers (FSDP's all-gathered block,
DDP's buckets beyond the gradients they hold), temporaries of the backward and the optimizer, the
allocator's rounding and the CUDA context; leave room for them under --memory-limit-mb.
"""

# mlscale train's options that change what a rank holds; their flags and checks come from mlscale.config
PLAN_OPTIONS = ("task", "task_options", "workers", "strategy", "batch_size", "grad_accum", "dtype", "precision",
                "optimizer", "momentum", "memory_limit_mb", "activation_checkpointing", "ac_every", "microbatches",
                "schedule")
DEFAULT_WORKERS = 4
HELP = {
    "workers": f"the job's size N: ddp on N processes, fsdp, tp and pipeline over every divisor of N from 2, fsdp x "
               f"tp over every split of N in two (default {DEFAULT_WORKERS})",
    "strategy": "plan only these strategies, comma-separated (ddp,fsdp,tp,pipeline; default all of them)",
    "activation_checkpointing": "what the 'with checkpointing' figures are for: full (every block; the default) or "
                                "selective (every K-th block, --ac-every); every figure is also given without",
    "memory_limit_mb": "one device's memory: each layout is marked yes, with checkpointing (only once the blocks' "
                       "activations are recomputed) or no",
}


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-rank memory of every strategy and degree, before running (no weights "
                       "allocated)", epilog=PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       arguments="mlscale.cli.plan:add_plan_arguments")
    p.set_defaults(handler=run_plan)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from mlscale.cli.train import FLAGS_PATH, _add_flag

    p.add_argument("--config", metavar="FILE", help="a TOML or JSON file of mlscale train's options (a run's "
                   "configuration); the flags given here override it")
    rows = {row["dest"]: row for row in json.loads(FLAGS_PATH.read_text())}
    groups: dict[str, Any] = {}
    for dest in PLAN_OPTIONS:
        row = {**rows[dest], "help": HELP.get(dest, rows[dest]["help"])}
        title = {"microbatches": "pipeline", "schedule": "pipeline"}.get(dest, "the job")
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        _add_flag(groups[title], row)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (every layout, every pipeline stage, "
                   "in report.json's memory keys)")


def run_plan(args: argparse.Namespace) -> int:
    from mlscale.train.memory_plan import plan_memory

    options = {dest: getattr(args, dest) for dest in PLAN_OPTIONS}
    if options["task_options"]:
        options["task_options"] = dict(options["task_options"])
    plan = plan_memory(options, config_file=args.config, default_workers=DEFAULT_WORKERS)
    print(as_json(plan.as_dict()) if args.json else describe(plan.as_dict()))
    return 0


def _mb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def describe(plan: dict[str, Any]) -> str:
    """The plan as a table, one row per layout; refused layouts and pipeline notes below it."""
    limit = plan["memory_limit_mb"]
    checkpointing = plan["activation_checkpointing"]
    headers = ["layout", "params", "grads", "optimizer", "activations", f"act. {checkpointing} ckpt", "total",
               "total ckpt", *(["fits"] if limit is not None else [])]
    rows, refused = [], []
    for layout in plan["layouts"]:
        if layout["refused"]:
            refused.append(f"  {layout['layout']}: {layout['refused']}")
            continue
        rank = layout["per_rank"]
        rows.append([layout["layout"], *(_mb(rank[key]) for key in (
            "params_mb", "grads_mb", "optimizer_mb", "activations_mb", "activations_checkpointed_mb", "total_mb",
            "total_checkpointed_mb")), *([layout["fits"]] if limit is not None else [])])
    options = ", ".join(f"{key}={value}" for key, value in plan["task_options"].items())
    task = f"{plan['task']} ({options})" if options else plan["task"]
    accumulated = f" x {plan['grad_accum']} accumulated" if plan["grad_accum"] > 1 else ""
    device = f"; device memory {limit:g} MB" if limit is not None else ""
    lines = [f"task {task}: batch {plan['batch_size']} per replica{accumulated}, {plan['dtype']}, "
             f"{plan['optimizer']}, precision {plan['precision']}; layouts of {plan['workers']} processes{device}",
             "MB per rank (rank 0, under fsdp the largest shard; a pipeline's largest stage), as report.json's "
             "memory counts them:", "", table(headers, rows)]
    if any(layout["stages"] > 1 and not layout["refused"] for layout in plan["layouts"]):  # a pipeline planned
        lines += ["", f"pipeline: microbatches of {plan['batch_size'] // plan['microbatches']} samples, "
                  f"{plan['schedule']} (activations of the microbatches in flight: estimated from the unsplit model; "
                  "no activation checkpointing)"]
    if refused:
        lines += ["", "not possible for this model or these options:", *refused]
    lines += ["", f"planned in {plan['seconds']:.1f} s without allocating the model (fake tensors); --json for "
              "every stage"]
    return "\n".join(lines)
