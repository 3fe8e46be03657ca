"""``mlscale bench train --scenario straggler``: how each way of synchronising copes with slow workers.

Modes: ddp (all-reduce), ps-bsp, ps-bsp with backup workers, ps-ssp, ps-async. Scenarios: no straggler;
a persistent straggler (one worker at half speed: slower by one compute time on every step); transient
stragglers (a random worker each step, slower by two compute times, on half the steps). Each worker's
step is a fixed simulated compute time (a sleep) on a tiny model, so that the CPU is not what sets the
pace: on a 2-core machine 4 worker processes would otherwise share the cores, and a sleeping straggler
would hand its core to the others, flattering every mode. Reported per run: useful samples/s (samples
whose gradients were applied, from the end of warm-up) and seconds of training to a target loss (the
loss ddp reaches without a straggler, +2%), medians over repeats, modes interleaved in each repeat.
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
from mlscale.cli.parsers import float_above, int_at_least, name_list
from mlscale.rundir import RunDir

MODES: dict[str, list[str]] = {
    "ddp": ["--strategy", "ddp"],
    "ps-bsp": ["--strategy", "ps", "--sync", "bsp"],
    "ps-bsp-backup1": ["--strategy", "ps", "--sync", "bsp", "--backup-workers", "1"],
    "ps-ssp": ["--strategy", "ps", "--sync", "ssp"],
    "ps-async": ["--strategy", "ps", "--sync", "async"],
}
TASKS: dict[str, dict[str, Any]] = {
    "digits": {},
    "synthetic": {"features": 32, "width": 64, "depth": 1, "samples": 8192},
}
SCENARIOS = ("none", "persistent", "transient")


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("straggler scenario (--scenario straggler)")
    group.add_argument("--tasks", type=name_list(TASKS), default=list(TASKS),
                       help=f"tasks, comma-separated (default {','.join(TASKS)})")
    group.add_argument("--modes", type=name_list(MODES), default=list(MODES),
                       help=f"modes, comma-separated (default {','.join(MODES)})")
    group.add_argument("--straggler-workers", type=int_at_least(2), default=4, metavar="N",
                       help="workers computing gradients (default 4; the parameter server adds 1 process)")
    group.add_argument("--compute-ms", type=float_above(0), default=50.0,
                       help="simulated compute time of every worker's step (default 50)")
    group.add_argument("--staleness", type=int_at_least(0), default=3, help="ssp bound (default 3)")


def _fault(scenario: str, workers_from: int, compute_ms: float) -> list[str]:
    if scenario == "persistent":  # the second worker at half speed
        return ["--fault", f"slow:rank={workers_from + 1}:delay_ms={compute_ms:g}"]
    if scenario == "transient":
        return ["--fault", f"slow:rank=any:delay_ms={2 * compute_ms:g}:p=0.5"]
    return []


def _run(task: str, mode: str, scenario: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    first_worker = 1 if mode.startswith("ps") else 0
    flags = MODES[mode] + _fault(scenario, first_worker, args.compute_ms)
    if mode == "ps-ssp":
        flags += ["--staleness", str(args.staleness)]
    overrides = _flags_to_config(flags)
    config = build_config(task=task, task_options=TASKS[task], workers=args.straggler_workers, steps=args.steps,
                          batch_size=32, lr=0.05, log_every=5, simulated_compute_ms=args.compute_ms,
                          run_dir=str(scratch / f"{task}-{mode}-{scenario}-{time.time_ns()}"),
                          warmup_steps_for_throughput=5, progress=False, **overrides)
    report = fit(config)
    lines = RunDir(config.run_dir or "").read_metrics()
    return {"samples_per_s": report["samples_per_s"], "final_loss": report["final_loss"],
            "eval": report["eval"], "stragglers": report["stragglers"],
            "curve": [(line["elapsed_s"], line["loss"]) for line in lines],
            "dropped": report.get("parameter_server", {}).get("gradients_dropped", 0),
            "applied_by_worker": report.get("parameter_server", {}).get("applied_by_worker"),
            "staleness_max": report.get("parameter_server", {}).get("staleness", {}).get("max", 0),
            "version_lag_max": report.get("parameter_server", {}).get("version_lag", {}).get("max", 0)}


def _flags_to_config(flags: list[str]) -> dict[str, Any]:
    """The few train flags the modes use, as configuration keys."""
    config: dict[str, Any] = {"faults": []}
    for flag, value in zip(flags[::2], flags[1::2]):
        key = flag.removeprefix("--").replace("-", "_")
        if key == "fault":
            config["faults"].append(value)
        else:
            config[key] = int(value) if value.isdigit() else value
    return config


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((elapsed for elapsed, loss in curve if loss <= target), None)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "benchmark": "train --scenario straggler: ddp and the parameter server's modes, with and without stragglers",
        "how": (f"{args.straggler_workers} workers, batch 32 each, {args.steps} steps (ps ssp/async: "
                f"{args.straggler_workers} x {args.steps} gradients), every step a simulated {args.compute_ms:g} ms "
                "of compute (sleep) on a tiny model so the 2 CPU cores do not set the pace; persistent: worker 2 "
                f"slower by {args.compute_ms:g} ms every step (half speed); transient: a random worker each step "
                f"slower by {2 * args.compute_ms:g} ms on half the steps; useful samples/s = applied samples from "
                "step 5 on; time to target = training seconds until the logged loss (mean of 5 steps) is at or below "
                "ddp's final loss without a straggler +2%; medians over repeats, modes interleaved"),
        "command": "mlscale bench train " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "train"] else "",
        "machine": machine_info(), "ideal_persistent": (args.straggler_workers - 0.5) / args.straggler_workers,
        "tasks": {},
    }
    runs = {task: {mode: {s: [] for s in SCENARIOS} for mode in args.modes} for task in args.tasks}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        for repeat in range(args.repeats):
            for task in args.tasks:
                for scenario in SCENARIOS:
                    order = args.modes if repeat % 2 == 0 else args.modes[::-1]
                    for mode in order:
                        run = _run(task, mode, scenario, args, Path(tmp))
                        runs[task][mode][scenario].append(run)
                        print(f"repeat {repeat + 1}/{args.repeats}  {task:<9} {scenario:<10} {mode:<15} "
                              f"{run['samples_per_s']:,.0f} samples/s  loss {run['final_loss']:.3f}",
                              file=sys.stderr, flush=True)
    for task in args.tasks:
        results["tasks"][task] = _summarise(runs[task], args.modes)
    return results


def _summarise(runs: dict[str, dict[str, list[dict[str, Any]]]], modes: list[str]) -> dict[str, Any]:
    reference = runs["ddp"]["none"] if "ddp" in runs else runs[modes[0]]["none"]
    base = statistics.median(r["samples_per_s"] for r in reference)
    target = statistics.median(r["final_loss"] for r in reference) * 1.02
    table: dict[str, Any] = {"target_loss": target, "reference_samples_per_s": base, "modes": {}}
    for mode in modes:
        table["modes"][mode] = {}
        for scenario, group in runs[mode].items():
            speeds = [r["samples_per_s"] for r in group]
            times = [time_to(r["curve"], target) for r in group]
            reached = [t for t in times if t is not None]
            own = statistics.median(r["samples_per_s"] for r in runs[mode]["none"])
            table["modes"][mode][scenario] = {
                "samples_per_s": speeds,
                "samples_per_s_median": statistics.median(speeds),
                "of_ddp_without_straggler": statistics.median(speeds) / base,
                "of_own_without_straggler": statistics.median(speeds) / own,
                "time_to_target_s": times,
                "time_to_target_s_median": statistics.median(reached) if len(reached) == len(times) else None,
                "final_loss_median": statistics.median(r["final_loss"] for r in group),
                "eval_accuracy_median": statistics.median(r["eval"].get("accuracy", float("nan")) for r in group),
                "gradients_dropped_median": statistics.median(r["dropped"] for r in group),
                "staleness_max": max(r["staleness_max"] for r in group),
                "version_lag_max": max(r["version_lag_max"] for r in group),
                "applied_by_worker": [r["applied_by_worker"] for r in group],
                "flagged": sorted({rank for r in group for rank in r["stragglers"]}),
            }
    return table


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    tasks = list(results["tasks"])
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        table = results["tasks"][task]["modes"]
        modes = list(table)
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(SCENARIOS))]
            speed = [table[mode][s]["of_ddp_without_straggler"] for s in SCENARIOS]
            times = [table[mode][s]["time_to_target_s_median"] or 0.0 for s in SCENARIOS]
            axes[row][0].bar(xs, speed, width, label=mode)
            axes[row][1].bar(xs, times, width, label=mode)
        axes[row][0].axhline(results["ideal_persistent"], color="black", linestyle="--", linewidth=1,
                             label=f"{results['ideal_persistent']:.1%}: the ideal with one worker at half speed")
        axes[row][0].set_ylabel("useful samples/s, of ddp without straggler")
        axes[row][1].set_ylabel(f"seconds to loss {results['tasks'][task]['target_loss']:.3f} (0: not reached)")
        for ax in axes[row]:
            ax.set_xticks(range(len(SCENARIOS)), [f"{task}: {s}" for s in SCENARIOS])
    handles, labels = axes[0][0].get_legend_handles_labels()
    axes[0][1].legend(handles, labels, loc="upper left", fontsize=8)  # the no-straggler bars are short there
    axes[0][1].set_ylim(top=axes[0][1].get_ylim()[1] * 1.7)
    fig.suptitle("Stragglers: throughput and time to a target loss (medians over repeats)")
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "train-straggler", results, plot)
    for task, table in results["tasks"].items():
        print(f"{task} (target loss {table['target_loss']:.3f}):")
        for mode, scenarios in table["modes"].items():
            cells = "  ".join(f"{s} {scenarios[s]['of_ddp_without_straggler']:.0%}" for s in SCENARIOS)
            print(f"  {mode:<15} {cells}")
    print(f"wrote {json_path} and {png_path}")
    return results
