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

MICROBATCHES = (1, 2, 4, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mlscale.cli_parsers import add_out_option, float_above, int_at_least

    add_out_option(p, "model-parallel")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="repeats of every configuration (default 3)")
    p.add_argument("--steps", type=int_at_least(6), default=14, help="steps per bubble run (default 14; 4 warm-up)")
    p.add_argument("--stage-ms", type=float_above(0), default=200.0,
                   help="simulated work of every stage per step (default 200)")
    p.add_argument("--stages", type=str, default="2,4", help="pipeline depths, comma-separated (default 2,4)")
    p.add_argument("--width", type=int_at_least(8), default=256, help="memory runs: tinylm width (default 256)")
    p.add_argument("--layers", type=int_at_least(4), default=8, help="memory runs: tinylm blocks (default 8)")


def _fit(scratch: Path, **options: Any) -> dict[str, Any]:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    config = build_config(run_dir=str(scratch / f"run-{time.time_ns()}"), progress=False, task="tinylm",
                          **options)
    return fit(config)


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
        "benchmark": "model-parallel: the pipeline bubble vs (P-1)/(M+P-1), and training-state memory per rank "
                     "for ddp, fsdp and pipeline",
        "how": (f"bubble: tinylm split into P stages (GPipe), every stage a simulated {args.stage_ms:g} ms of work "
                "per step (sleep; forward 1/3, backward 2/3, split over M microbatches), median step time T after "
                f"4 warm-up steps of {args.steps}, slowest rank; bubble = 1 - W/T; bubble_net removes the "
                "pipeline's own per-step overhead T0 (the same run without simulated work): 1 - W/(T - T0); "
                f"medians over {args.repeats} repeats, loaded and idle runs alternated. memory: tinylm width "
                f"{args.width}, {args.layers} blocks, float32, Adam, batch 8 per replica, 2 steps; parameters + "
                "gradients + optimizer state measured per rank on the tensors it holds after the first step; "
                "peak_mb is the process's peak resident set (interpreter, torch, data included)"),
        "command": "mlscale bench model-parallel " + " ".join(sys.argv[3:])
        if sys.argv[1:3] == ["bench", "model-parallel"] else "",
        "machine": machine_info(),
    }
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        results["bubble"] = bubble(args, Path(tmp))
        results["memory"] = memory(args, Path(tmp))
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for stages, rows in results["bubble"].items():
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
    names = ["ddp", "fsdp", "pipeline"]
    groups = list(results["memory"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [statistics.mean(m["state_mb"] for m in results["memory"][g][name]) for g in groups]
        xs = [j + (i - 1) * width for j in range(len(groups))]
        bars = right.bar(xs, values, width, label=name)
        right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_xticks(range(len(groups)), [f"{g} processes" for g in groups])
    right.set_ylabel("MB per rank: parameters + gradients + optimizer state")
    right.set_title("Training state per rank (measured, mean over ranks)")
    right.legend()
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "model-parallel", results, plot)
    print(f"wrote {json_path} and {png_path}")
    return results
