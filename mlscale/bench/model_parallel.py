"""``mlscale bench model-parallel``: the pipeline bubble against (P-1)/(M+P-1), and memory per rank.

Bubble. A pipeline of P stages on tinylm, GPipe schedule, M = 1, 2, 4, 8 microbatches. Every stage's
work per step is a simulated ``--stage-ms`` (a sleep, split over the microbatches: a third in each
forward, two thirds in each backward), so the stages are uniform and the 2 CPU cores do not set the
pace; the model itself is tiny. Measured: the median step time T over the steps after warm-up. The
bubble is the idle share of a stage's step, 1 - W/T (W the work per step), compared with GPipe's
(P-1)/(M+P-1). The same runs with no simulated work give the pipeline's own overhead per step (sends,
receives, the schedule), which the bubble includes; ``bubble_net`` subtracts it: 1 - W/(T - T0).

Memory. tinylm at ``--width`` x ``--layers`` with Adam, one run per strategy (ddp, fsdp, pipeline)
on N = 2 and 4 processes: the parameters, gradients and optimizer state each rank holds, measured on
its tensors after the first step (``report.json`` ``memory``), and the process's peak resident set.

Strategies. The model of ``--task`` (default tinylm; e.g. ``tests.user_models:llama`` from the repository,
a Hugging Face Llama) under ddp, fsdp, tp, fsdp x tp and pipeline on N = 2 and 4 processes, ddp/fsdp/tp
with and without full activation checkpointing: per rank the measured parameters, gradients, optimizer
state and activations (``report.json`` ``memory``) beside ``mlscale plan``'s prediction of each (made on
fake tensors before the run); and samples/s relative to ddp at the same global batch (tp and pipeline,
one replica, take N x the per-replica batch). Activation checkpointing's step-time cost: one process,
with and without full checkpointing, alternated, median step time after warm-up (anchor: about one more
forward, at most +35% of the step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, float_above, int_at_least, name_list
from mlscale.cli.train import key_value
from mlscale.errors import MlscaleError, UsageError

MICROBATCHES = (1, 2, 4, 8)
SECTIONS = ("bubble", "memory", "strategies", "checkpointing")
# The layouts measured on N processes: (name, options); fsdp x tp needs N = 4.
LAYOUTS = (
    ("ddp", {"strategy": "ddp"}),
    ("ddp+ac", {"strategy": "ddp", "activation_checkpointing": "full"}),
    ("fsdp", {"strategy": "fsdp"}),
    ("fsdp+ac", {"strategy": "fsdp", "activation_checkpointing": "full"}),
    ("tp", {"strategy": "tp"}),
    ("tp+ac", {"strategy": "tp", "activation_checkpointing": "full"}),
    ("fsdp x tp", {"strategy": "fsdp", "tp": 2}),
    ("pipeline", {"strategy": "pipeline", "schedule": "1f1b"}),
)
MEMORY_KEYS = ("params_mb", "grads_mb", "optimizer_mb", "activations_mb")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "model-parallel")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="repeats of every configuration (default 3)")
    p.add_argument("--steps", type=int_at_least(6), default=14, help="steps per bubble run (default 14; 4 warm-up)")
    p.add_argument("--stage-ms", type=float_above(0), default=200.0,
                   help="simulated work of every stage per step (default 200)")
    p.add_argument("--stages", type=str, default="2,4", help="pipeline depths, comma-separated (default 2,4)")
    p.add_argument("--width", type=int_at_least(8), default=256, help="memory runs: tinylm width (default 256)")
    p.add_argument("--layers", type=int_at_least(4), default=8, help="memory runs: tinylm blocks (default 8)")
    p.add_argument("--task", default="tinylm", help="strategies runs: the task (default tinylm at --width x "
                   "--layers; a Hugging Face model: tests.user_models:llama from the repository's root)")
    p.add_argument("--task-opt", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="strategies runs: an option of --task (repeatable)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8,
                   help="strategies runs: samples per data-parallel replica (default 8)")
    p.add_argument("--sections", type=name_list(SECTIONS), default=list(SECTIONS),
                   help=f"what to measure, comma-separated (default all: {','.join(SECTIONS)})")


def _fit(scratch: Path, **options: Any) -> dict[str, Any]:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    options.setdefault("task", "tinylm")
    config = build_config(run_dir=str(scratch / f"run-{time.time_ns()}"), progress=False, **options)
    return fit(config)


def _job(args: argparse.Namespace) -> dict[str, Any]:
    """The task and training options every strategies run shares."""
    task_options = dict(args.task_opt)
    if args.task == "tinylm":
        task_options = {"dim": args.width, "layers": args.layers, "heads": 4, "samples": 512, **task_options}
    return {"task": args.task, "task_options": task_options, "optimizer": "adam", "lr": 1e-3,
            "batch_size": args.batch_size}


def _layout_options(name: str, options: dict[str, Any], processes: int, batch_size: int) -> dict[str, Any]:
    """A layout's options for ``processes`` at the global batch of ddp on as many: tp and pipeline train
    one replica, so it takes the processes' batches together."""
    one_replica = options["strategy"] in ("tp", "pipeline")
    layout = {**options, "workers": processes, "batch_size": batch_size * processes if one_replica else batch_size}
    if options["strategy"] == "pipeline":
        layout.update(stages=processes, microbatches=max(processes, 4))
    return layout


def _predicted(job: dict[str, Any], layout: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``mlscale plan``'s per-rank prediction for one layout (pipeline: per stage), in report.json's keys."""
    from mlscale.train.memory_plan import plan_memory

    options = {key: value for key, value in {**job, **layout}.items() if key != "tp"}  # it plans every tp itself
    try:
        plan = plan_memory(options)
    except UsageError as exc:
        print(f"mlscale plan: {exc}", file=sys.stderr, flush=True)
        return None
    tp, stages = layout.get("tp", 1), layout.get("stages", 1)
    for entry in plan.layouts:
        shape = entry.layout
        if (shape.strategy, shape.processes, shape.tp, shape.stages) == (layout["strategy"], layout["workers"],
                                                                          tp if layout["strategy"] != "tp" else
                                                                          layout["workers"], stages):
            if entry.refused:
                return None
            checkpointed = layout.get("activation_checkpointing", "none") != "none"
            rows = []
            for rank in entry.ranks:
                row = rank.as_mb()
                if checkpointed and row["activations_checkpointed_mb"] is not None:
                    row["activations_mb"] = row["activations_checkpointed_mb"]
                rows.append(row)
            return rows
    return None


def strategies(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Memory per rank (measured and predicted) and samples/s of every layout on 2 and 4 processes."""
    job, table = _job(args), {}
    for processes in (2, 4):
        rows: dict[str, Any] = {}
        for name, options in LAYOUTS:
            if name == "fsdp x tp" and processes < 4:
                continue
            layout = _layout_options(name, options, processes, args.batch_size)
            try:
                report = _fit(scratch, **{**job, **layout}, steps=8, warmup_steps_for_throughput=3, log_every=8,
                              async_checkpoint=False)
            except MlscaleError as exc:  # a layout this model cannot take (heads the degree does not divide)
                rows[name] = {"options": layout, "refused": str(exc)}
                print(f"N={processes} {name}: refused: {exc}", file=sys.stderr, flush=True)
                continue
            predicted = _predicted(job, layout)
            rows[name] = {"options": layout, "measured": report["memory"], "predicted": predicted,
                          "samples_per_s": report["samples_per_s"], "global_batch": layout["batch_size"] * (
                              1 if options["strategy"] in ("tp", "pipeline") else processes)}
            measured = report["memory"][0]
            guess = (predicted or [{}])[0]
            print(f"N={processes} {name}: measured rank 0 " + ", ".join(
                f"{key[:-3]} {measured.get(key, 0):.2f}" for key in MEMORY_KEYS) + " MB; predicted " + ", ".join(
                f"{key[:-3]} {guess.get(key) or 0:.2f}" for key in MEMORY_KEYS) +
                f" MB; {report['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
        ddp = rows["ddp"]["samples_per_s"]
        for row in rows.values():
            if "samples_per_s" in row:
                row["samples_per_s_vs_ddp"] = row["samples_per_s"] / ddp
        table[str(processes)] = rows
    return table


def checkpointing_cost(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """One process, with and without full activation checkpointing, alternated: the median step time."""
    job, times = _job(args), {"none": [], "full": []}
    for repeat in range(args.repeats):
        order = ["none", "full"] if repeat % 2 == 0 else ["full", "none"]
        for mode in order:
            report = _fit(scratch, **job, steps=12, warmup_steps_for_throughput=4, log_every=12,
                          activation_checkpointing=mode, async_checkpoint=False)
            times[mode].append(max(rank["step_ms_p50"] for rank in report["per_rank"]))
    none, full = statistics.median(times["none"]), statistics.median(times["full"])
    print(f"activation checkpointing: step {none:.1f} ms without, {full:.1f} ms with full (x{full / none:.2f})",
          file=sys.stderr, flush=True)
    return {"step_ms": times, "step_ms_median": {"none": none, "full": full}, "ratio": full / none,
            "anchor_ratio_max": 1.35}


def _bubble_run(scratch: Path, stages: int, microbatches: int, stage_ms: float, steps: int) -> float:
    report = _fit(scratch, task_options={"dim": 16, "layers": 2 * stages, "heads": 2, "samples": 512},
                  strategy="pipeline", schedule="gpipe", workers=stages, stages=stages, microbatches=microbatches,
                  batch_size=8, steps=steps, warmup_steps_for_throughput=4, simulated_compute_ms=stage_ms,
                  log_every=steps)
    return max(rank["step_ms_p50"] for rank in report["per_rank"])


def bubble(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for stages in [int(s) for s in args.stages.split(",")]:
        rows = {}
        for microbatches in MICROBATCHES:
            loaded, idle = [], []
            for repeat in range(args.repeats):
                pair = [(0.0, "idle"), (args.stage_ms, "loaded")]
                for work, kind in pair if repeat % 2 == 0 else pair[::-1]:
                    step_ms = _bubble_run(scratch, stages, microbatches, work, args.steps)
                    (loaded if kind == "loaded" else idle).append(step_ms)
            t, t0 = statistics.median(loaded), statistics.median(idle)
            rows[microbatches] = {
                "step_ms": loaded, "step_ms_without_work": idle, "step_ms_median": t, "overhead_ms_median": t0,
                "bubble": 1 - args.stage_ms / t, "bubble_net": 1 - args.stage_ms / max(t - t0, args.stage_ms),
                "ideal": (stages - 1) / (microbatches + stages - 1),
            }
            print(f"P={stages} M={microbatches}: step {t:.0f} ms (overhead {t0:.0f} ms), bubble "
                  f"{rows[microbatches]['bubble']:.3f} net {rows[microbatches]['bubble_net']:.3f}, ideal "
                  f"{rows[microbatches]['ideal']:.3f}", file=sys.stderr, flush=True)
        table[str(stages)] = rows
    return table


def memory(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    layouts = {
        "ddp": lambda n: {"strategy": "ddp", "workers": n},
        "fsdp": lambda n: {"strategy": "fsdp", "workers": n},
        "pipeline": lambda n: {"strategy": "pipeline", "workers": n, "stages": n, "microbatches": n},
    }
    table: dict[str, Any] = {}
    for n in (2, 4):
        for name, layout in layouts.items():
            report = _fit(scratch, task_options={"dim": args.width, "layers": args.layers, "heads": 4,
                                                 "samples": 256}, optimizer="adam", lr=1e-3, batch_size=8,
                          steps=2, async_checkpoint=False, **layout(n))
            table.setdefault(str(n), {})[name] = report["memory"]
            state = [m["state_mb"] for m in report["memory"]]
            print(f"N={n} {name}: state MB per rank {[round(s, 1) for s in state]}", file=sys.stderr, flush=True)
    return table


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "benchmark": "model-parallel: the pipeline bubble vs (P-1)/(M+P-1); training-state memory per rank for "
                     "ddp, fsdp and pipeline; per strategy (ddp, fsdp, tp, fsdp x tp, pipeline, with and without "
                     "activation checkpointing) memory per rank measured beside mlscale plan's prediction and "
                     "samples/s relative to ddp; activation checkpointing's step-time cost",
        "how": (f"bubble: tinylm split into P stages (GPipe), every stage a simulated {args.stage_ms:g} ms of work "
                "per step (sleep; forward 1/3, backward 2/3, split over M microbatches), median step time T after "
                f"4 warm-up steps of {args.steps}, slowest rank; bubble = 1 - W/T; bubble_net removes the "
                "pipeline's own per-step overhead T0 (the same run without simulated work): 1 - W/(T - T0); "
                f"medians over {args.repeats} repeats, loaded and idle runs alternated. memory: tinylm width "
                f"{args.width}, {args.layers} blocks, float32, Adam, batch 8 per replica, 2 steps; parameters + "
                "gradients + optimizer state measured per rank on the tensors it holds after the first step; "
                "peak_mb is the process's peak resident set (interpreter, torch, data included). strategies: "
                f"task {args.task} {dict(args.task_opt)}, float32, Adam, batch {args.batch_size} per data-parallel "
                "replica (tp and pipeline: N x that, one replica), 8 steps, samples/s after 3 warm-up steps; "
                "memory per rank after the first step (report.json), predicted by mlscale plan on fake tensors "
                "before the run. checkpointing: one process, 12 steps, median step time after 4 warm-up, "
                f"{args.repeats} alternated repeats each"),
        "command": "mlscale bench model-parallel " + " ".join(sys.argv[3:])
        if sys.argv[1:3] == ["bench", "model-parallel"] else "",
        "machine": machine_info(),
    }
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        if "bubble" in args.sections:
            results["bubble"] = bubble(args, Path(tmp))
        if "memory" in args.sections:
            results["memory"] = memory(args, Path(tmp))
        if "strategies" in args.sections:
            results["strategies"] = strategies(args, Path(tmp))
        if "checkpointing" in args.sections:
            results["checkpointing"] = checkpointing_cost(args, Path(tmp))
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    panels = [name for name in ("bubble", "memory", "strategies", "checkpointing") if name in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for axis, name in zip(axes[0], panels):
        {"bubble": _plot_bubble, "memory": _plot_memory, "strategies": _plot_strategies,
         "checkpointing": _plot_checkpointing}[name](axis, results[name])
    save_figure(fig, path)


def _plot_bubble(left: Any, table: dict[str, Any]) -> None:
    for stages, rows in table.items():
        ms = [int(m) for m in rows]
        line = left.plot(ms, [rows[m]["bubble"] for m in rows], "o-", label=f"P={stages} measured")[0]
        left.plot(ms, [rows[m]["bubble_net"] for m in rows], "s:", color=line.get_color(),
                  label=f"P={stages} measured, overhead removed")
        left.plot(ms, [rows[m]["ideal"] for m in rows], "--", color=line.get_color(), alpha=0.6,
                  label=f"P={stages} (P-1)/(M+P-1)")
    left.set_xscale("log", base=2)
    left.set_xticks(list(MICROBATCHES), [str(m) for m in MICROBATCHES])
    left.set_xlabel("microbatches M")
    left.set_ylabel("bubble: idle share of a stage's step")
    left.set_title("Pipeline bubble (GPipe, uniform simulated stages)")
    left.legend(fontsize=7)


def _plot_memory(right: Any, table: dict[str, Any]) -> None:
    names = ["ddp", "fsdp", "pipeline"]
    groups = list(table)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [statistics.mean(m["state_mb"] for m in table[g][name]) for g in groups]
        xs = [j + (i - 1) * width for j in range(len(groups))]
        bars = right.bar(xs, values, width, label=name)
        right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_xticks(range(len(groups)), [f"{g} processes" for g in groups])
    right.set_ylabel("MB per rank: parameters + gradients + optimizer state")
    right.set_title("Training state per rank (tinylm; measured, mean over ranks)")
    right.legend()


def _plot_strategies(axis: Any, table: dict[str, Any]) -> None:
    """Rank 0's measured bytes, stacked by kind, on 4 processes; the prediction's total as a marker."""
    rows = {name: row for name, row in table[max(table, key=int)].items() if "measured" in row}
    names = list(rows)
    bottom = [0.0] * len(names)
    for key in MEMORY_KEYS:
        values = [rows[name]["measured"][0].get(key, 0.0) for name in names]
        axis.bar(range(len(names)), values, 0.6, bottom=bottom, label=key.removesuffix("_mb"))
        bottom = [b + v for b, v in zip(bottom, values)]
    predicted = [sum((rows[name]["predicted"] or [{}])[0].get(key) or 0.0 for key in MEMORY_KEYS) for name in names]
    axis.plot(range(len(names)), predicted, "k_", markersize=22, markeredgewidth=2, label="mlscale plan's prediction")
    for x, name in enumerate(names):
        axis.annotate(f"{rows[name]['samples_per_s_vs_ddp']:.2f}x", (x, bottom[x]), ha="center", va="bottom",
                      fontsize=8)
    axis.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axis.set_ylabel("MB on rank 0 (label: samples/s vs ddp)")
    axis.set_title(f"Per-rank memory, {max(table, key=int)} processes: measured vs predicted")
    axis.legend(fontsize=7)


def _plot_checkpointing(axis: Any, table: dict[str, Any]) -> None:
    medians = table["step_ms_median"]
    bars = axis.bar(["none", "full"], [medians["none"], medians["full"]], 0.5, color=["tab:blue", "tab:orange"])
    axis.bar_label(bars, fmt="%.0f ms", fontsize=8)
    axis.axhline(medians["none"] * table["anchor_ratio_max"], color="k", linestyle="--", linewidth=1,
                 label="anchor: +35% (one more forward)")
    axis.set_ylabel("median step time (ms), one process")
    axis.set_title(f"Activation checkpointing: x{table['ratio']:.2f} the step")
    axis.legend(fontsize=7)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "model-parallel", results, plot)
    print(f"wrote {json_path} and {png_path}")
    return results
