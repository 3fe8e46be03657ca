"""``mlscale bench data --suite resume``: how long a resume mid-epoch at another world size takes to
reach its first training step, against starting the same run fresh.

A run of the ``slow_items`` task (``data_sets.py``: a user's map-style Dataset, 0.2 ms of Python work an
item) trains ``--resume-at`` steps on 2 workers and checkpoints: mid-epoch (the epoch holds more steps).
Each repeat then launches, as a user does (``python -m mlscale train``, a new process), on 3 workers:

- resume: a copy of that run directory with ``--resume --workers 3``: the newest checkpoint is loaded, the
  position (a global sample offset) is re-sharded over 3 workers, and training goes on from the next step;
- fresh: the same task and options in a new run directory, from step 0.

Time to the first step: from just before the process is started to the ``time`` of the first line of
``metrics.jsonl`` it writes (``--log-every 1``: written right after that step, by rank 0), so the
interpreter's start, imports, the launcher, 3 workers' start and rendezvous, building the model and the
data, loading the checkpoint (resume) and the first batch and step are all in it. Each side runs 2
steps and ends; fresh and resume alternate, the order reversed every other repeat; medians. The
report.json of each resume is checked to say it resumed from that step at world size 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlscale.rundir import RunDir

TASK = "mlscale.bench.data_sets:slow_items"
FROM_WORLD, TO_WORLD, BATCH, STEPS_AFTER = 2, 3, 64, 2


def _train_first(task_options: dict[str, Any], steps: int, run_dir: Path) -> dict[str, Any]:
    """The run to resume: ``steps`` steps on 2 workers, checkpointed at its end (``fit``, in this process's
    launcher; its start time is not left behind for the timed launches)."""
    from mlscale.config import build_config
    from mlscale.train.dist import JOB_START_ENV
    from mlscale.train.launcher import fit

    before = os.environ.get(JOB_START_ENV)
    try:
        return fit(build_config(task=TASK, task_options=task_options, workers=FROM_WORLD, steps=steps,
                                batch_size=BATCH, lr=0.05, log_every=1, progress=False, run_dir=str(run_dir)))
    finally:
        if before is None:
            os.environ.pop(JOB_START_ENV, None)  # fit sets it for its workers; a later launch must set its own
        else:
            os.environ[JOB_START_ENV] = before


def _launch(argv: list[str], run_dir: Path, after_step: int) -> dict[str, Any]:
    """``python -m mlscale train ARGV`` to its end; the seconds from its start to its first step (the
    first metrics line past ``after_step``) and to its exit."""
    from mlscale.train.dist import JOB_START_ENV

    env = {key: value for key, value in os.environ.items() if key != JOB_START_ENV}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "mlscale", "train", *argv], capture_output=True, text=True, env=env,
                          timeout=900)
    wall = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"mlscale train {' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    records = RunDir(run_dir)
    first = next(row for row in records.read_metrics() if row["step"] > after_step)
    report = records.read_report()
    return {"first_step_s": first["time"] - start, "wall_s": wall, "first_step": first["step"],
            "first_step_epoch": first["epoch"], "world_size": report["world_size"],
            "resumed_from_step": report.get("resumed_from_step"),
            "resumed_from_world_size": report.get("resumed_from_world_size")}


def run_resume(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The resume section of ``data.json``."""
    from mlscale.bench.data_sets import loops_for

    loops = loops_for(args.item_ms)
    samples = args.resume_samples
    options = {"samples": samples, "loops": loops}
    per_epoch = samples // (FROM_WORLD * BATCH)
    if not 0 < args.resume_at < per_epoch:
        raise ValueError(f"--resume-at {args.resume_at} is not mid-epoch: an epoch has {per_epoch} steps on "
                         f"{FROM_WORLD} workers")
    base = scratch / "resume-base"
    print(f"resume: training {args.resume_at} steps on {FROM_WORLD} workers to resume from", file=sys.stderr,
          flush=True)
    _train_first(options, args.resume_at, base)
    opts = [word for key, value in options.items() for word in ("--task-opt", f"{key}={value}")]
    common = ["--log-every", "1", "--no-progress"]
    runs: dict[str, list[dict[str, Any]]] = {"fresh": [], "resume": []}
    for repeat in range(args.repeats):
        for side in ("fresh", "resume") if repeat % 2 == 0 else ("resume", "fresh"):
            run_dir = scratch / f"{side}-{repeat}"
            if side == "resume":
                shutil.copytree(base, run_dir)
                argv = ["--run-dir", str(run_dir), "--resume", "--workers", str(TO_WORLD),
                        "--steps", str(args.resume_at + STEPS_AFTER), *common]
                run = _launch(argv, run_dir, after_step=args.resume_at)
                if (run["resumed_from_step"], run["resumed_from_world_size"]) != (args.resume_at, FROM_WORLD):
                    raise RuntimeError(f"the resumed run says it resumed from step {run['resumed_from_step']} at "
                                       f"world size {run['resumed_from_world_size']}")
            else:
                argv = ["--task", TASK, *opts, "--workers", str(TO_WORLD), "--steps", str(STEPS_AFTER),
                        "--batch-size", str(BATCH), "--lr", "0.05", "--run-dir", str(run_dir), *common]
                run = _launch(argv, run_dir, after_step=0)
            runs[side].append(run)
            print(f"resume: repeat {repeat + 1}/{args.repeats}  {side:<6} first step after {run['first_step_s']:.2f} s "
                  f"(process {run['wall_s']:.2f} s)", file=sys.stderr, flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    summary = {side: {"first_step_s": statistics.median(r["first_step_s"] for r in group),
                      "min_first_step_s": min(r["first_step_s"] for r in group),
                      "max_first_step_s": max(r["first_step_s"] for r in group),
                      "wall_s": statistics.median(r["wall_s"] for r in group), "runs": group}
               for side, group in runs.items()}
    offset = args.resume_at * FROM_WORLD * BATCH
    return {
        "how": (f"task {TASK} ({samples:,} items, {loops:,} loops ~ {args.item_ms:g} ms an item, batch {BATCH} per "
                f"worker); {args.resume_at} steps on {FROM_WORLD} workers, checkpointed at the end = sample "
                f"{offset:,} of {samples:,} of epoch 0; then, in new processes (python -m mlscale train, 2 steps, "
                f"--log-every 1), resume on {TO_WORLD} workers from a copy of that run directory vs the same run "
                f"fresh on {TO_WORLD} workers; time to first step = time of its first metrics.jsonl line - time "
                f"just before the process started; {args.repeats} repeats, sides alternated; medians"),
        "task": TASK, "task_options": options, "from_world_size": FROM_WORLD, "to_world_size": TO_WORLD,
        "resumed_at_step": args.resume_at, "resumed_at_sample": offset, "steps_per_epoch_before": per_epoch,
        "repeats": args.repeats, **summary,
        "resume_over_fresh": statistics.median(r["first_step_s"] / f["first_step_s"]
                                               for r, f in zip(runs["resume"], runs["fresh"])),
        "resume_minus_fresh_s": summary["resume"]["first_step_s"] - summary["fresh"]["first_step_s"],
    }


def plot_resume(ax: Any, section: dict[str, Any]) -> None:
    """Fresh vs resume: the seconds to the first step (median, min-max), with the ratio."""
    sides = ["fresh", "resume"]
    medians = [section[s]["first_step_s"] for s in sides]
    errors = [[m - section[s]["min_first_step_s"] for m, s in zip(medians, sides)],
              [section[s]["max_first_step_s"] - m for m, s in zip(medians, sides)]]
    labels = [f"fresh on {section['to_world_size']} workers",
              f"resume on {section['to_world_size']} workers\nfrom step {section['resumed_at_step']} of a "
              f"{section['from_world_size']}-worker run\n(mid-epoch)"]
    bars = ax.bar(labels, medians, yerr=errors, capsize=5, color=["tab:gray", "tab:blue"])
    ax.bar_label(bars, [f"{m:.2f} s" for m in medians], label_type="center", color="white", fontweight="bold")
    ax.set_ylabel("launch to first step, s (median, min-max)")
    ax.set_title(f"Time to the first step: resume/fresh {section['resume_over_fresh']:.2f}x "
                 f"({section['resume_minus_fresh_s']:+.2f} s)", fontsize=9)


__all__ = ["plot_resume", "run_resume"]
