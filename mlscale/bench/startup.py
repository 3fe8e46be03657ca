"""``mlscale bench startup``: what starting workers warm saves, at the job's start and at a restart.

Workers started cold (``MLSCALE_WARM_WORKERS=0``: each a fresh ``python -m mlscale.train``) against
workers forked by the job's zygote (mlscale/train/warm.py), side by side: each repeat runs ``mlscale
train`` once each way (the order alternates), a small 2-worker job with one restart: worker 1 is
killed by ``--fault kill`` before step K. Measured from each run's directory:

- first step: from launching ``mlscale train`` (this process starts it) to the first step's metrics
  line (``metrics.jsonl``, logged every step), the interpreter's own start and imports included;
- restart downtime: from the kill (``logs/faults.jsonl``) to the first step completed after the
  restart (``report.json`` ``recovery.events``): the agent's detection, the restarted workers' start,
  their rendezvous and the checkpoint's reload.
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

from mlscale.bench.machine import machine_info
from mlscale.bench.recovery import add_kill_options
from mlscale.bench.report import median_panels, write_results
from mlscale.cli.parsers import add_out_option
from mlscale.rundir import RunDir

MODES = ("cold", "warm")
VICTIM = 1
METRICS = (("first_step_s", "launch to first step (s)"),
           ("restart_downtime_s", "restart downtime: kill to next step (s)"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "startup")
    add_kill_options(p, workers=2, steps=12, kill_step=7, checkpoint_every=4, fewest_steps=4)


def train_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """``mlscale train`` of the measured job: the digits MLP, one restart allowed, every step logged."""
    return [sys.executable, "-m", "mlscale", "train", "--task", "digits", "--workers", str(args.workers),
            "--steps", str(args.steps), "--batch-size", "16", "--checkpoint-every", str(args.checkpoint_every),
            "--max-restarts", "1", "--fault", f"kill:rank={VICTIM}:step={args.kill_step}", "--log-every", "1",
            "--no-progress", "--no-plot", "--run-dir", str(run_dir)]


def run_once(args: argparse.Namespace, mode: str, run_dir: Path) -> dict[str, Any]:
    """One job in ``mode``; its two times, read from its run directory."""
    env = {**os.environ, "MLSCALE_WARM_WORKERS": "1" if mode == "warm" else "0"}
    launched = time.time()
    result = subprocess.run(train_command(args, run_dir), env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"mlscale train ({mode}) failed: {result.stderr[-2000:]}")
    run = RunDir(run_dir)
    [event] = run.read_report()["recovery"]["events"]
    starts = [json.loads(line) for line in run.warm_starts_path.read_text().splitlines()] \
        if run.warm_starts_path.exists() else []
    return {"first_step_s": run.read_metrics()[0]["time"] - launched, "restart_downtime_s": event["downtime_s"],
            "zygote": sorted({s["zygote"] for s in starts}), "workers_forked": len(starts)}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    load_before = os.getloadavg()  # other processes on the cores stretch both modes' times
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-startup-") as tmp:
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                row = run_once(args, mode, Path(tmp) / f"{mode}-{repeat}")
                runs[mode].append(row)
                print(f"repeat {repeat + 1}/{args.repeats}  {mode:<5}  first step {row['first_step_s']:5.2f} s  "
                      f"restart downtime {row['restart_downtime_s']:5.2f} s", file=sys.stderr, flush=True)
    median = {mode: {key: statistics.median(r[key] for r in runs[mode]) for key, _ in METRICS} for mode in MODES}
    return {
        "benchmark": "workers started cold (a fresh interpreter each) vs warm (forked by the job's zygote): "
                     "time to the first step and a restart's downtime",
        "how": f"mlscale train of the digits MLP on {args.workers} workers (gloo), batch 16, {args.steps} steps, "
               f"checkpoint every {args.checkpoint_every}, worker {VICTIM} SIGKILLed before step {args.kill_step} "
               f"(--fault), one restart; {args.repeats} repeats, modes alternated; first step from launching "
               "mlscale train to the first metrics line; downtime from the kill to the first step after the restart",
        "command": "mlscale bench startup " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "startup"] else "",
        "machine": machine_info(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "runs": runs,
        "median": median,
        "warm_over_cold": {key: median["warm"][key] / median["cold"][key] for key, _ in METRICS},
    }


def plot(results: dict[str, Any], path: Path) -> None:
    median_panels({mode: results["runs"][mode] for mode in MODES}, METRICS,
                  f"Workers started cold vs forked by the job's zygote (median of {len(results['runs']['cold'])}, "
                  "range as error bars)", path, width=5)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "startup", results, plot)
    for key, label in METRICS:
        cold, warm = (results["median"][mode][key] for mode in MODES)
        print(f"{label:<42} cold {cold:5.2f}  warm {warm:5.2f}  ({warm / cold:.2f}x)")
    print(f"wrote {json_path} and {png_path}")
    return results
