"""``mlscale bench data``: does the input pipeline keep training fed?

One worker trains the synthetic MLP (256 -> 2048 x 2 -> 10 by default) on samples that need an
expensive per-sample transform (``transform_rounds`` rotations of each 256-feature sample by a fixed
matrix). Modes, interleaved in every repeat: ``naive`` (the transform in the training process, batch
by batch), ``workers`` (2 DataLoader worker processes, 2 batches prefetched each), ``workers+cache``
(the same, transformed samples kept in shared memory after the first epoch). Reported: the data-wait
share of the step time (median data wait / median step, after warm-up) and samples/s, medians over
repeats.
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

MODES: dict[str, dict[str, Any]] = {
    "naive": {},
    "workers": {"data_workers": 2},
    "workers+cache": {"data_workers": 2, "data_cache": True},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mlscale.cli_parsers import add_out_option, int_at_least

    add_out_option(p, "data")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="interleaved repeats (default 3)")
    p.add_argument("--steps", type=int_at_least(20), default=120, help="steps per run (default 120: 3 epochs)")
    p.add_argument("--width", type=int_at_least(8), default=2048, help="MLP width: the training compute per "
                   "step (default 2048)")
    p.add_argument("--rounds", type=int_at_least(1), default=40, help="transform cost: rotations per sample "
                   "(default 40)")


def _run(mode: str, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    config = build_config(task="synthetic", task_options={"samples": 2560, "features": 256, "width": args.width,
                                                          "transform_rounds": args.rounds},
                          steps=args.steps, batch_size=64, lr=0.01, progress=False, log_every=20,
                          warmup_steps_for_throughput=10, run_dir=str(scratch / f"{mode}-{time.time_ns()}"),
                          **MODES[mode])
    report = fit(config)
    rank = report["per_rank"][0]
    return {"samples_per_s": report["samples_per_s"], "data_wait_ms_p50": rank["data_wait_ms_p50"],
            "step_ms_p50": rank["step_ms_p50"], "data_wait_share": rank["data_wait_ms_p50"] / rank["step_ms_p50"]}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "benchmark": "data: the input pipeline (DataLoader workers, prefetch, shared cache) vs loading in the "
                     "training process, on a task with an expensive per-sample transform",
        "how": (f"1 training process, synthetic 256 -> {args.width} x 2 -> 10 MLP, 2,560 samples (40 batches of 64 an "
                f"epoch), transform = {args.rounds} rotations of each sample by a fixed 256 x 256 matrix, "
                f"{args.steps} steps, medians after 10 warm-up steps; data-wait share = median data wait / "
                f"median step; {args.repeats} repeats, modes interleaved; 2 CPU cores shared by the training "
                "process and the data workers"),
        "command": "mlscale bench data " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "data"] else "",
        "machine": machine_info(), "goal": "data wait <= 5% of step time with the pipeline", "modes": {},
    }
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else list(MODES)[::-1]:
                run = _run(mode, args, Path(tmp))
                runs[mode].append(run)
                print(f"repeat {repeat + 1}/{args.repeats}  {mode:<14} {run['samples_per_s']:,.0f} samples/s  data "
                      f"wait {run['data_wait_share']:.1%} of the step", file=sys.stderr, flush=True)
    naive = statistics.median(r["samples_per_s"] for r in runs["naive"])
    for mode, group in runs.items():
        medians = {key: statistics.median(r[key] for r in group) for key in group[0]}
        results["modes"][mode] = {**medians, "runs": group, "samples_per_s_vs_naive": medians["samples_per_s"] / naive}
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    modes = list(results["modes"])
    table = results["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = left.bar(modes, [100 * table[m]["data_wait_share"] for m in modes], color=["grey", "tab:blue", "tab:green"])
    left.bar_label(bars, fmt="%.1f%%")
    left.axhline(5, color="black", linestyle="--", linewidth=1, label="goal: 5%")
    left.set_ylabel("data wait, % of step time")
    left.legend()
    bars = right.bar(modes, [table[m]["samples_per_s"] for m in modes], color=["grey", "tab:blue", "tab:green"])
    right.bar_label(bars, fmt="%.0f")
    right.set_ylabel("samples/s")
    fig.suptitle("Input pipeline on an expensive per-sample transform (medians)")
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "data", results, plot)
    for mode, row in results["modes"].items():
        print(f"  {mode:<14} data wait {row['data_wait_share']:.1%} of the step, {row['samples_per_s']:,.0f} "
              f"samples/s ({row['samples_per_s_vs_naive']:.2f}x naive)")
    print(f"wrote {json_path} and {png_path}")
    return results
