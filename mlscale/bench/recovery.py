"""``mlscale bench recovery``: what one failure costs under restart-all vs per-step fault tolerance.

Both modes train the same job (3 workers, a small model with a fixed simulated compute per step, the same
checkpoint interval) twice per repeat: once with worker 1 killed by SIGKILL before step K, once without a
failure. Measured per killed run, from the run directory:

- lost time per failure: the job's wall time from the kill to the last step, minus what the steps left
  take at the steady step time of the same mode's failure-free run (restart: detection, restart, reload,
  redone steps; per-step: the survivors' wait for the lighthouse to leave the dead replica out);
- rejoin time: from the kill to the first committed step of the replacement (restart: of the restarted
  group);
- steps redone (restart: back to the checkpoint; per-step: steps the quorum discarded) and samples never
  trained (per-step: the dead replica's batches while it was down);
- no-failure overhead: plain DDP's samples/s over per-step's, failure-free runs side by side.
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
from mlscale.bench.report import median_panels, write_results
from mlscale.cli.parsers import add_out_option, int_at_least
from mlscale.common.io import read_jsonl
from mlscale.rundir import RunDir

MODES = ("restart", "per-step")
VICTIM = 1
BATCH = 32
ANCHOR = ("torchft documents no per-step overhead figure that we found (its design overlaps an asynchronous "
          "quorum with the forward pass; third-party write-ups call the cost negligible for steps of seconds); "
          "the anchor measured here is plain DDP at the same step time")


def add_kill_options(p: argparse.ArgumentParser, *, workers: int, steps: int, kill_step: int, checkpoint_every: int,
                     fewest_steps: int) -> None:
    """The options of a benchmark of a job whose worker 1 is killed (here, and ``mlscale bench startup``)."""
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="repeats of each run (default 3)")
    p.add_argument("--workers", type=int_at_least(2), default=workers,
                   help=f"workers / replica groups (default {workers})")
    p.add_argument("--steps", type=int_at_least(fewest_steps), default=steps,
                   help=f"training steps per run (default {steps})")
    p.add_argument("--kill-step", type=int_at_least(2), default=kill_step,
                   help=f"worker 1 is killed before this step (default {kill_step})")
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=checkpoint_every,
                   help=f"every run (default {checkpoint_every})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "recovery")
    add_kill_options(p, workers=3, steps=40, kill_step=12, checkpoint_every=10, fewest_steps=10)
    p.add_argument("--compute-ms", type=float, default=500.0, help="simulated compute per step (default 500)")
    p.add_argument("--heartbeat-timeout-ms", type=int_at_least(50), default=300,
                   help="per-step: how long the lighthouse waits for a silent replica (default 300)")


def _config(args: argparse.Namespace, mode: str, kill: bool, run_dir: Path) -> Any:
    from mlscale import TrainConfig

    per_step = {"fault_tolerance": "per-step", "heartbeat_timeout_ms": args.heartbeat_timeout_ms} \
        if mode == "per-step" else {}
    return TrainConfig(task="digits", workers=args.workers, steps=args.steps, batch_size=BATCH,
                       simulated_compute_ms=args.compute_ms, checkpoint_every=args.checkpoint_every,
                       max_restarts=1, progress=False, collective_timeout_s=30,
                       faults=[f"kill:rank={VICTIM}:step={args.kill_step}"] if kill else [],
                       run_dir=str(run_dir), **per_step)


def _lines(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def failure_costs(run_dir: Path, mode: str, steady_s: float, steps: int, kill_step: int) -> dict[str, float]:
    """What the kill cost in a killed run's directory (see the module's docstring)."""
    from mlscale.train.strategies.per_step import read_replica_logs

    run = RunDir(run_dir)
    report = run.read_report()
    killed_at = _lines(run.faults_path)[0]["time"]
    end = run.read_metrics()[-1]["time"]
    left = steps - (kill_step - 1)  # the steps from the one the victim died before, to the end
    costs = {"lost_s": (end - killed_at) - left * steady_s, "steady_step_s": steady_s}
    if mode == "restart":
        [event] = report["recovery"]["events"]
        costs.update(rejoin_s=event["downtime_s"], steps_redone=event["steps_redone"], samples_not_trained=0)
        return costs
    logs = read_replica_logs(run_dir)
    replacement = [line for line in logs[VICTIM, 0] if line["event"] == "step" and line["committed"]
                   and line["time"] > killed_at]
    discarded = max(sum(1 for line in lines if line["event"] == "step" and not line["committed"])
                    for (group, _), lines in logs.items() if group != VICTIM)
    survivors_ms = [line["ms"] for (group, _), lines in logs.items() if group != VICTIM for line in lines
                    if line["event"] == "step" and line["committed"]]
    costs.update(rejoin_s=replacement[0]["time"] - killed_at, steps_redone=discarded,
                 samples_not_trained=report["recovery"]["samples_not_trained"],
                 survivor_step_max_over_median=max(survivors_ms) / statistics.median(survivors_ms))
    return costs


def run_once(args: argparse.Namespace, mode: str, kill: bool, scratch: Path) -> tuple[Path, dict[str, Any]]:
    from mlscale import fit

    run_dir = scratch / f"{mode}-{'kill' if kill else 'clean'}-{time.time_ns()}"
    report = fit(_config(args, mode, kill, run_dir))
    return run_dir, report


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-recovery-") as tmp:
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                _, clean = run_once(args, mode, False, Path(tmp))
                killed_dir, _ = run_once(args, mode, True, Path(tmp))
                steady_s = args.workers * BATCH / clean["samples_per_s"]  # wall time per step, warm-up left out
                row = {"samples_per_s_no_failure": clean["samples_per_s"],
                       **failure_costs(killed_dir, mode, steady_s, args.steps, args.kill_step)}
                runs[mode].append(row)
                print(f"repeat {repeat + 1}/{args.repeats}  {mode:<8}  lost {row['lost_s']:6.2f} s  rejoin "
                      f"{row['rejoin_s']:5.2f} s  redone {row['steps_redone']}  not trained "
                      f"{row['samples_not_trained']}  {row['samples_per_s_no_failure']:,.1f} samples/s",
                      file=sys.stderr, flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    step_s = med("per-step", "steady_step_s")
    overhead = med("restart", "samples_per_s_no_failure") / med("per-step", "samples_per_s_no_failure") - 1
    return {
        "benchmark": "one failure under restart-all (torch elastic agent + checkpoint) vs per-step fault tolerance "
                     "(torchft), and the failure-free overhead of per-step vs plain DDP",
        "how": f"{args.workers} workers on gloo, digits MLP with {args.compute_ms:g} ms simulated compute per step, "
               f"{args.steps} steps, batch 32 per worker, checkpoint every {args.checkpoint_every} steps in both "
               f"modes, worker {VICTIM} SIGKILLed before step {args.kill_step} (at a step boundary), one restart "
               f"allowed; per-step lighthouse heartbeat timeout {args.heartbeat_timeout_ms} ms; {args.repeats} "
               "repeats, modes alternated; each repeat runs a failure-free and a killed run of each mode",
        "command": "mlscale bench recovery " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "recovery"]
        else "",
        "anchor": ANCHOR,
        "workers": args.workers,
        "machine": machine_info(),
        "runs": runs,
        "median": {mode: {key: med(mode, key) for key in runs[mode][0]} for mode in MODES},
        "per_step_overhead_vs_ddp": overhead,
        "goals": {"survivors_lose_less_than_one_step": med("per-step", "lost_s") < step_s,
                  "no_steps_redone": med("per-step", "steps_redone") == 0,
                  "overhead_within_5_percent": overhead <= 0.05},
    }


PANELS = (("lost_s", "survivors' lost time per failure (s)"), ("rejoin_s", "replacement's time to rejoin (s)"),
          ("steps_redone", "steps redone"), ("samples_not_trained", "samples not trained"),
          ("samples_per_s_no_failure", "samples/s without failure"))


def plot(results: dict[str, Any], path: Path) -> None:
    median_panels({mode: results["runs"][mode] for mode in MODES}, PANELS,
                  f"One SIGKILL in a {results['workers']}-worker run: restart-all vs per-step "
                  f"(no-failure overhead {results['per_step_overhead_vs_ddp']:+.1%} vs DDP)", path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "recovery", results, plot)
    print(f"{'':<10}{'lost s':>8}{'rejoin s':>10}{'redone':>8}{'not trained':>13}{'samples/s':>11}")
    for mode in MODES:
        row = results["median"][mode]
        print(f"{mode:<10}{row['lost_s']:>8.2f}{row['rejoin_s']:>10.2f}{row['steps_redone']:>8.0f}"
              f"{row['samples_not_trained']:>13,.0f}{row['samples_per_s_no_failure']:>11,.1f}")
    print(f"per-step overhead without failure vs DDP: {results['per_step_overhead_vs_ddp']:+.1%}")
    print(f"wrote {json_path} and {png_path}")
    return results
