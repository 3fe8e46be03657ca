"""``mlscale bench train --scenario comm``: what gradient compression and accumulation save.

Two ddp workers (gloo) train the synthetic MLP; modes, interleaved in every repeat:

- ``none``: a plain all-reduce of fp32 gradients every step (the baseline, DDP's default hook);
- ``fp16`` / ``bf16``: the gradients cast to 16 bits for the all-reduce (DDP's compression hooks);
- ``powersgd``: rank-2 PowerSGD with error feedback after 10 plain steps (DDP's PowerSGD hook);
- ``sync-every-micro`` vs ``accum4``: the same micro-batch, synchronised every micro-step or once per
  4 (``--grad-accum 4``); measured per sample, as the optimizer steps differ.

Reported per mode: bytes each rank sent per optimizer step and per sample (measured in the hook from
the tensors it all-reduces), samples/s after warm-up, communication busy time per step, eval loss;
medians over repeats. On one machine over loopback, communication is cheap next to compute, so the
bytes are the robust result and the speed-ups are a lower bound of what a network would show.
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
    "none": {},
    "fp16": {"compress": "fp16"},
    "bf16": {"compress": "bf16"},
    "powersgd": {"compress": "powersgd"},
    "sync-every-micro": {"micro": True},
    "accum4": {"grad_accum": 4, "micro": True},
}


def _run(mode: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    options = dict(MODES[mode])
    micro = options.pop("micro", False)
    batch = args.batch_size // 4 if micro else args.batch_size
    steps = args.steps * 4 if mode == "sync-every-micro" else args.steps
    config = build_config(task="synthetic", task_options={"samples": 16384, "features": 256, "width": args.width,
                                                          "depth": args.depth},
                          workers=2, steps=steps, batch_size=batch, lr=0.01, lr_schedule="constant", progress=False,
                          log_every=max(10, steps // 5), warmup_steps_for_throughput=10,
                          run_dir=str(scratch / f"{mode}-{time.time_ns()}"), **options)
    report = fit(config)
    comm = report["communication"]
    samples_per_step = report["samples_seen"] / report["steps"] / 2  # per rank
    return {"samples_per_s": report["samples_per_s"], "bytes_per_step": comm["bytes_sent_per_step"],
            "bytes_per_sample": comm["bytes_sent_per_step"] / samples_per_step,
            "comm_ms_p50": statistics.median(r["comm_ms_p50"] for r in report["per_rank"]),
            "step_ms_p50": statistics.median(r["step_ms_p50"] for r in report["per_rank"]),
            "eval_loss": report["eval"]["loss"]}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "benchmark": "train --scenario comm: gradient compression and accumulation vs a plain all-reduce",
        "how": (f"2 ddp workers (gloo, loopback), synthetic MLP 256 -> {args.width} x {args.depth} -> 10, batch "
                f"{args.batch_size} per worker ({args.batch_size // 4} per micro-step for sync-every-micro and "
                f"accum4), {args.steps} optimizer steps (sync-every-micro: {4 * args.steps}), 10 warm-up steps; "
                "bytes = what rank 0 handed to the all-reduce, measured in the DDP comm hook from the tensors "
                f"(16-bit casts, PowerSGD's P and Q factors and uncompressed 1-D tensors); medians over "
                f"{args.repeats} repeats, modes interleaved"),
        "command": "mlscale bench train " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "train"] else "",
        "machine": machine_info(), "modes": {},
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else list(MODES)[::-1]:
                run = _run(mode, args, Path(tmp))
                runs[mode].append(run)
                print(f"repeat {repeat + 1}/{args.repeats}  {mode:<17} {run['samples_per_s']:,.0f} samples/s  "
                      f"{run['bytes_per_step'] / 1e6:.3f} MB/step", file=sys.stderr, flush=True)
    base = {key: statistics.median(r[key] for r in runs["none"]) for key in runs["none"][0]}
    for mode, group in runs.items():
        medians = {key: statistics.median(r[key] for r in group) for key in group[0]}
        results["modes"][mode] = {**medians, "runs": group,
                                  "bytes_per_sample_vs_none": medians["bytes_per_sample"] / base["bytes_per_sample"],
                                  "samples_per_s_vs_none": medians["samples_per_s"] / base["samples_per_s"],
                                  "eval_loss_vs_none": medians["eval_loss"] / base["eval_loss"]}
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    modes = list(results["modes"])
    table = results["modes"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in ((axes[0], "bytes_per_sample_vs_none", "bytes sent per sample, of none"),
                           (axes[1], "samples_per_s_vs_none", "samples/s, of none"),
                           (axes[2], "eval_loss_vs_none", "eval loss, of none")):
        bars = ax.bar(modes, [table[m][key] for m in modes], color=["grey", *["tab:blue"] * 3, "grey", "tab:green"])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Communication: compression hooks and gradient accumulation (2 ddp workers, medians)")
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "train-comm", results, plot)
    for mode, row in results["modes"].items():
        print(f"  {mode:<17} bytes/sample {row['bytes_per_sample_vs_none']:.3f}  samples/s "
              f"{row['samples_per_s_vs_none']:.3f}  eval loss {row['eval_loss_vs_none']:.3f} (of none)")
    print(f"wrote {json_path} and {png_path}")
    return results
