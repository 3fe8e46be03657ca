"""``mlscale bench checkpoint``: how long saving a checkpoint stalls training, blocking vs async.

Both modes train the same model (>= 100 MB of model + optimizer state) for the same steps with the
same checkpoint interval, alternately, for several repeats. Stall = time the training thread spends in
a checkpoint call (gathering RNG states, copying the state to CPU memory and, when blocking, writing
and fsyncing the file); the final checkpoint is left out (no training left to stall). Also reported:
the run's training throughput (which includes the stalls and, for async, the background writer's
competition for the CPU) and the time to write one file.
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
from mlscale.bench.report import median_bars, pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, int_at_least

MODES = ("blocking", "async")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "checkpoint")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="alternating repeats of each mode (default 3)")
    p.add_argument("--steps", type=int_at_least(1), default=40, help="training steps per run (default 40)")
    p.add_argument("--every", type=int_at_least(1), default=8, help="checkpoint interval in steps (default 8)")
    p.add_argument("--width", type=int_at_least(1), default=3072, help="MLP width; 3072 x 3 layers = 153 MB of state")
    p.add_argument("--depth", type=int_at_least(1), default=3, help="hidden layers (default 3)")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch threads for training (default 1: the other core is free for the writer, as the CPU "
                   "is on a GPU node)")


def _state_mb(width: int, depth: int, features: int = 64, classes: int = 10) -> float:
    params = features * width + width + (depth - 1) * (width * width + width) + width * classes + classes
    return params * 4 * 2 / 1e6  # fp32 weights + SGD momentum


def run_once(args: argparse.Namespace, mode: str, scratch: Path) -> dict[str, float]:
    from mlscale import TrainConfig, fit  # torch: loaded when a benchmark runs, not by every `mlscale` command

    config = TrainConfig(task="synthetic", task_options={"samples": 2048, "width": args.width, "depth": args.depth},
                         steps=args.steps, batch_size=32, lr=0.01, lr_schedule="constant",
                         checkpoint_every=args.every, keep_checkpoints=2, async_checkpoint=mode == "async",
                         log_every=args.steps, run_dir=str(scratch / f"{mode}-{time.time_ns()}"))
    report = fit(config)
    checkpoint = report["checkpoint"]
    return {"stall_ms_p50": checkpoint["stall_ms_p50"], "stall_ms_max": checkpoint["stall_ms_max"],
            "write_ms_p50": checkpoint["write_ms_p50"], "samples_per_s": report["samples_per_s"]}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-ckpt-") as tmp:
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                row = run_once(args, mode, Path(tmp))
                runs[mode].append(row)
                print(f"repeat {repeat + 1}/{args.repeats}  {mode:<8} stall p50 {row['stall_ms_p50']:8.1f} ms  "
                      f"write {row['write_ms_p50']:8.1f} ms  {row['samples_per_s']:,.0f} samples/s",
                      file=sys.stderr, flush=True)
    torch.set_num_threads(threads)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    return {
        "benchmark": "checkpoint stall: blocking torch.save on the training thread vs async (copy, then write "
                     "on a background thread)",
        "how": f"1 worker, synthetic MLP width {args.width} depth {args.depth} "
               f"({_state_mb(args.width, args.depth):.0f} MB model + optimizer state), {args.steps} steps, checkpoint "
               f"every {args.every} steps, {args.threads} torch thread(s), modes alternated, {args.repeats} repeats; "
               "stall = training thread time "
               "in the checkpoint call, final checkpoint excluded",
        "command": "mlscale bench checkpoint " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "checkpoint"]
        else "",
        "machine": machine_info(),
        "state_mb": _state_mb(args.width, args.depth),
        "runs": runs,
        "median": {mode: {key: med(mode, key) for key in runs[mode][0]} for mode in MODES},
        "stall_ratio_blocking_over_async": med("blocking", "stall_ms_p50") / med("async", "stall_ms_p50"),
        "throughput_ratio_async_over_blocking": med("async", "samples_per_s") / med("blocking", "samples_per_s"),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (stall_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((stall_ax, "stall_ms_p50", "training stall per checkpoint (ms)"),
                           (speed_ax, "samples_per_s", "training throughput (samples/s)")):
        median_bars(ax, MODES, [[r[key] for r in results["runs"][mode]] for mode in MODES])
        ax.set_title(label)
    fig.suptitle(f"Checkpointing {results['state_mb']:.0f} MB of state: blocking vs async "
                 f"(stall {results['stall_ratio_blocking_over_async']:.1f}x lower)")
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "checkpoint", results, plot)
    for mode in MODES:
        row = results["median"][mode]
        print(f"{mode:<8} stall p50 {row['stall_ms_p50']:,.1f} ms, write {row['write_ms_p50']:,.1f} ms, "
              f"{row['samples_per_s']:,.0f} samples/s")
    print(f"stall blocking/async: {results['stall_ratio_blocking_over_async']:.1f}x; throughput async/blocking: "
          f"{results['throughput_ratio_async_over_blocking']:.3f}")
    print(f"wrote {json_path} and {png_path}")
    return results
