"""``mlscale bench train``: our trainer vs a plain hand-written DDP loop, side by side.

For each world size both run the same model, data, batch and number of steps, alternately, for several
repeats; we report samples/s of each (median, min, max) and the median of the per-repeat ratios
ours/plain. Writes ``train.json`` and ``train.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlscale.bench import train_comm, train_stragglers
from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, int_at_least, int_list

WARMUP = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "train")
    p.add_argument("--scenario", choices=("anchor", "straggler", "comm"), default="anchor",
                   help="anchor (default): our trainer vs a plain DDP loop; straggler: ddp and the parameter "
                   "server's modes with and without slow workers; comm: gradient compression and accumulation "
                   "vs a plain all-reduce (bytes sent, samples/s)")
    p.add_argument("--workers", type=int_list(1), default=[1, 2],
                   help="world sizes to compare, comma-separated (default 1,2)")
    p.add_argument("--repeats", type=int_at_least(1), default=None,
                   help="alternating repeats (default 5; straggler: 3)")
    p.add_argument("--steps", type=int_at_least(WARMUP + 1), default=None,
                   help=f"steps per run, the first {WARMUP} are warm-up (default 300; straggler: 80)")
    p.add_argument("--batch-size", type=int_at_least(1), default=128, help="per worker (default 128)")
    p.add_argument("--width", type=int_at_least(1), default=1024,
                   help="hidden width of the synthetic MLP (default 1024)")
    p.add_argument("--depth", type=int_at_least(1), default=2, help="hidden layers of the synthetic MLP (default 2)")
    train_stragglers.add_arguments(p)


def _task(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": "synthetic", "lr": 0.01,
            "options": {"samples": 16384, "features": 256, "classes": 10, "width": args.width, "depth": args.depth}}


def run_ours(task: dict[str, Any], workers: int, steps: int, batch: int, scratch: Path) -> float:
    from mlscale import TrainConfig, fit  # torch: loaded when a benchmark runs, not by every `mlscale` command

    config = TrainConfig(task=task["name"], task_options=task["options"], workers=workers, steps=steps,
                         batch_size=batch, lr=task["lr"], lr_schedule="constant", log_every=max(10, steps // 5),
                         run_dir=str(scratch / f"ours-{time.time_ns()}"), warmup_steps_for_throughput=WARMUP)
    return fit(config)["samples_per_s"]


def run_plain(task: dict[str, Any], workers: int, steps: int, batch: int, scratch: Path) -> float:
    out = scratch / f"plain-{time.time_ns()}.json"
    args = [str(out), json.dumps(task), str(steps), str(batch), str(WARMUP)]
    if workers == 1:
        from mlscale.bench.plain_ddp import main

        main(args)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                   "-m", "mlscale.bench.plain_ddp", *args]
        subprocess.run(command, check=True, capture_output=True, env=_launch_env())
    return json.loads(out.read_text())["samples_per_s"]


def _launch_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    task = _task(args)
    results: dict[str, Any] = {
        "benchmark": "train: mlscale trainer (ddp) vs plain hand-written torch DDP loop",
        "how": f"synthetic MLP width {args.width} depth {args.depth}, batch {args.batch_size}/worker, "
               f"{args.steps} steps, throughput from step {WARMUP} on (rank 0 wall clock), runs alternated",
        "command": "mlscale bench train " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "train"] else "",
        "machine": machine_info(), "task": task, "world_sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        scratch = Path(tmp)
        for workers in args.workers:
            ours, plain = [], []
            for repeat in range(args.repeats):
                pair = [("ours", run_ours), ("plain", run_plain)]
                for name, runner in pair if repeat % 2 == 0 else pair[::-1]:
                    value = runner(task, workers, args.steps, args.batch_size, scratch)
                    (ours if name == "ours" else plain).append(value)
                    print(f"workers {workers}  repeat {repeat + 1}/{args.repeats}  {name:<5} {value:,.0f} samples/s",
                          file=sys.stderr, flush=True)
            ratios = [o / p for o, p in zip(ours, plain)]
            results["world_sizes"][str(workers)] = {
                "ours_samples_per_s": ours, "plain_samples_per_s": plain,
                "ours": _summary(ours), "plain": _summary(plain),
                "ratio_ours_over_plain": _summary(ratios),
            }
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    sizes = list(results["world_sizes"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for offset, name, color in ((-0.2, "ours", "tab:blue"), (0.2, "plain", "tab:gray")):
        stats = [results["world_sizes"][s][name] for s in sizes]
        medians = [s["median"] for s in stats]
        errors = [[m - s["min"] for m, s in zip(medians, stats)], [s["max"] - m for m, s in zip(medians, stats)]]
        ax.bar([i + offset for i in range(len(sizes))], medians, 0.4, yerr=errors, capsize=4, color=color,
               label="mlscale" if name == "ours" else "plain DDP loop")
    for i, size in enumerate(sizes):
        row = results["world_sizes"][size]
        top = max(row["ours"]["max"], row["plain"]["max"])
        ax.annotate(f"ours/plain {row['ratio_ours_over_plain']['median']:.3f}x", (i, top), xytext=(0, 6),
                    textcoords="offset points", ha="center")
    ax.set_xticks(range(len(sizes)), [f"{s} worker(s)" for s in sizes])
    ax.set_ylabel("samples/s (median, min-max)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.12)
    ax.set_title("Training throughput: mlscale vs plain DDP")
    ax.legend()
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    straggler = args.scenario == "straggler"
    args.repeats = args.repeats or (5 if args.scenario == "anchor" else 3)
    args.steps = args.steps or {"anchor": 300, "straggler": 80, "comm": 100}[args.scenario]
    if args.scenario == "comm":
        return train_comm.run_from_args(args)
    if straggler:
        return train_stragglers.run_from_args(args)
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "train", results, plot)
    for size, row in results["world_sizes"].items():
        print(f"workers {size}: mlscale {row['ours']['median']:,.0f} samples/s, plain {row['plain']['median']:,.0f}"
              f" samples/s, ratio {row['ratio_ours_over_plain']['median']:.3f}")
    print(f"wrote {json_path} and {png_path}")
    return results
