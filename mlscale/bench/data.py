"""``mlscale bench data``: does the input pipeline keep training fed, and what do users' own Datasets cost?

Three suites, all of them by default, into one data.json and data.png in --out: pipeline (the data wait of a
training step on a costly transform: in the training process vs DataLoader workers vs workers and a cache),
loaders (batches/s of a user's map-style Dataset, 0.2 ms of Python work an item or variable-length text
padded with a mask, through mlscale's loaders at 0, 1, 2 data workers and auto vs a plain torch DataLoader
at its best num_workers) and resume (launch to first step of a resume mid-epoch on 3 workers of a 2-worker
run, vs starting fresh).

The pipeline suite: one worker trains the synthetic MLP (256 -> 2048 x 2 -> 10 by default) on samples that
need an expensive per-sample transform (``transform_rounds`` rotations of each 256-feature sample by a fixed
matrix). Modes, interleaved in every repeat: ``naive`` (the transform in the training process, batch by
batch), ``workers`` (2 DataLoader worker processes, 2 batches prefetched each), ``workers+cache`` (the same,
transformed samples kept in shared memory after the first epoch). Reported: the data-wait share of the step
time (median data wait / median step, after warm-up) and samples/s, medians over repeats. The loaders and
resume suites say how they measure in ``data_loaders.py`` and ``data_resume.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlscale.bench.data_loaders import plot_loaders, plot_tuning, run_loaders
from mlscale.bench.data_resume import plot_resume, run_resume
from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, float_above, int_at_least

MODES: dict[str, dict[str, Any]] = {
    "naive": {},
    "workers": {"data_workers": 2},
    "workers+cache": {"data_workers": 2, "data_cache": True},
}
SUITES = ("pipeline", "loaders", "resume", "images", "text")
ALL = ("pipeline", "loaders", "resume")  # --suite all: about 6 minutes; images and text are asked for by name
# the loaders' runs are seconds: more repeats for the median
REPEATS = {"pipeline": 3, "loaders": 7, "resume": 5, "images": 3, "text": 3}
LOADER_BATCH = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "data")
    p.add_argument("--suite", choices=("all", *SUITES), default="all",
                   help="what to measure (default all: pipeline, loaders and resume, about 6 minutes on 2 cores): "
                   "pipeline: data wait of a training step, naive vs DataLoader workers vs cache, on a costly "
                   "per-sample transform; loaders: batches/s of a user's map-style Dataset through mlscale's loaders "
                   "(0, 1, 2 data workers, auto) vs a plain torch DataLoader at its best num_workers; resume: launch "
                   "to first step of a mid-epoch resume on another number of workers vs a fresh start; images: "
                   "JPEG decoding and augmentation, mlscale vs the DataLoader, tf.data and the cores, and from S3; "
                   "text: tokens/s of tokenizing and packing, mlscale vs a plain loop")
    p.add_argument("--repeats", type=int_at_least(1), default=None,
                   help="interleaved repeats (default: pipeline 3, loaders 7, resume 5, images 3, text 3)")
    p.add_argument("--steps", type=int_at_least(20), default=120, help="pipeline: steps per run (default 120: 3 "
                   "epochs)")
    p.add_argument("--width", type=int_at_least(8), default=2048, help="pipeline: MLP width, the training compute "
                   "per step (default 2048)")
    p.add_argument("--rounds", type=int_at_least(1), default=40, help="pipeline: transform cost, rotations per "
                   "sample (default 40)")
    p.add_argument("--item-ms", type=float_above(0), default=0.2, help="loaders, resume: pure-Python work per item "
                   "of the Dataset, in ms (default 0.2; calibrated to this machine)")
    p.add_argument("--batches", type=int_at_least(1), default=200, help="loaders: timed batches of 64 per "
                   "measurement (default 200)")
    p.add_argument("--warmup", type=int_at_least(1), default=10, help="loaders: batches before the timing, worker "
                   "start-up among them (default 10)")
    p.add_argument("--resume-at", type=int_at_least(1), default=10, help="resume: the step of the 2-worker run's "
                   "checkpoint to resume from, mid-epoch (default 10 of 30 an epoch)")
    p.add_argument("--resume-samples", type=int_at_least(2 * LOADER_BATCH * 2), default=3840,
                   help="resume: the Dataset's size (default 3840: 30 steps an epoch on 2 workers)")
    p.add_argument("--images", type=int_at_least(200), default=20000, help="images: JPEGs generated (128-256 px, 10 "
                   "classes; default 20000)")
    p.add_argument("--image-dir", metavar="DIR", help="images: keep the generated JPEGs in DIR and reuse them "
                   "(default: a temporary folder, made each run)")
    p.add_argument("--crop", type=int_at_least(8), default=224, help="images: random resized crop, px (default 224)")
    p.add_argument("--image-batches", type=int_at_least(2), default=50, help="images: timed batches of 64 per "
                   "measurement (default 50)")
    p.add_argument("--tf-python", metavar="PYTHON", default=_default_tf_python(),
                   help="images: a Python with tensorflow-cpu for the tf.data anchor (default .venv-tf/bin/python when "
                   "there: `make bench-tf-env`; none: tf.data is not measured)")
    p.add_argument("--train-steps", type=int_at_least(0), default=30, help="images: steps of an end-to-end run of "
                   "--task images on 2 workers, for each rank's data wait (default 30; 0: none)")
    p.add_argument("--rss-images", type=int_at_least(0), default=2000, help="images: the resident memory of reading "
                   "tar shards of this many images and of 10 times as many (default 2000; 0: not measured)")
    p.add_argument("--documents", type=int_at_least(100), default=20000, help="text: documents generated (200-2,000 "
                   "characters; default 20000)")
    p.add_argument("--seq-len", type=int_at_least(8), default=512, help="text: tokens a window (default 512)")
    p.add_argument("--tokenize-workers", type=int_at_least(0), default=0, help="text: the processes that share the "
                   "tokenizing pass beside the tokenizer's threads (--data-workers N; default 0: one per core)")
    p.add_argument("--no-s3", dest="s3", action="store_false", help="images: skip reading the images from moto's "
                   "S3 server on 127.0.0.1 (first and second epoch)")


def _run(mode: str, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    config = build_config(task="synthetic", task_options={"samples": 2560, "features": 256, "width": args.width,
                                                          "transform_rounds": args.rounds},
                          steps=args.steps, batch_size=64, lr=0.01, progress=False, log_every=20,
                          warmup_steps_for_throughput=10, run_dir=str(scratch / f"{mode}-{time.time_ns()}"),
                          **MODES[mode])
    report = fit(config)
    gc.collect()  # fit leaves its DataLoader workers to the garbage collector: gone before the next run starts
    rank = report["per_rank"][0]
    return {"samples_per_s": report["samples_per_s"], "data_wait_ms_p50": rank["data_wait_ms_p50"],
            "step_ms_p50": rank["step_ms_p50"], "data_wait_share": rank["data_wait_ms_p50"] / rank["step_ms_p50"]}


def run_pipeline(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The pipeline section: naive vs workers vs workers+cache while training."""
    repeats = _repeats(args, "pipeline")
    section: dict[str, Any] = {
        "how": (f"1 training process, synthetic 256 -> {args.width} x 2 -> 10 MLP, 2,560 samples (40 batches of 64 an "
                f"epoch), transform = {args.rounds} rotations of each sample by a fixed 256 x 256 matrix, "
                f"{args.steps} steps, medians after 10 warm-up steps; data-wait share = median data wait / "
                f"median step; {repeats} repeats, modes interleaved; 2 CPU cores shared by the training "
                "process and the data workers"),
        "goal": "data wait <= 5% of step time with the pipeline", "modes": {},
    }
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else list(MODES)[::-1]:
            run = _run(mode, args, scratch)
            runs[mode].append(run)
            print(f"pipeline: repeat {repeat + 1}/{repeats}  {mode:<14} {run['samples_per_s']:,.0f} samples/s  data "
                  f"wait {run['data_wait_share']:.1%} of the step", file=sys.stderr, flush=True)
    naive = statistics.median(r["samples_per_s"] for r in runs["naive"])
    for mode, group in runs.items():
        medians = {key: statistics.median(r[key] for r in group) for key in group[0]}
        section["modes"][mode] = {**medians, "runs": group, "samples_per_s_vs_naive": medians["samples_per_s"] / naive}
    return section


def _repeats(args: argparse.Namespace, suite: str) -> int:
    return args.repeats or REPEATS[suite]


NOTES = [
    "The machine has 2 CPU cores, shared by the measuring (or training) process and every DataLoader worker "
    "process: 2 workers plus the consumer oversubscribe it, and the cores were also shared with other users' "
    "jobs; medians of interleaved repeats are reported, min-max in the plot.",
    "loaders: nothing is done with a batch, so a loader's batches/s is its ceiling; under training the workers "
    "would compete with the training step for the same 2 cores.",
    "loaders: mlscale's loaders read items through MapData (a SampleError naming the sample on failure, floats "
    "cast to the training dtype) and, with workers, ship each item's index with it (the exact resume position); "
    "the plain DataLoader does neither.",
    "resume: both sides pay Python start-up, imports, the launcher, 3 worker processes and their rendezvous; "
    "the resume also loads the checkpoint and re-shards the epoch's remaining order over 3 workers.",
]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    suites = ALL if args.suite == "all" else (args.suite,)
    results: dict[str, Any] = {
        "benchmark": "data: the input pipeline (DataLoader workers, prefetch, shared cache) vs loading in the "
                     "training process on a task with an expensive per-sample transform; users' own map-style "
                     "Datasets through mlscale's loaders vs a plain torch DataLoader; time to the first step of a "
                     "mid-epoch resume at another world size vs a fresh start",
        "how": f"suites {', '.join(suites)}, run one after the other; each section's 'how' says how it was measured",
        "command": "mlscale bench data " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "data"] else "",
        "machine": machine_info(), "suites": list(suites), "notes": NOTES,
    }
    started = time.perf_counter()
    results["load_average_at_start"] = _load_average()
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-") as tmp:
        if "pipeline" in suites:
            results["pipeline"] = run_pipeline(args, Path(tmp))
        if "loaders" in suites:
            results["loaders"] = run_loaders(_with(args, repeats=_repeats(args, "loaders"), batch_size=LOADER_BATCH))
        if "resume" in suites:
            results["resume"] = run_resume(_with(args, repeats=_repeats(args, "resume")), Path(tmp))
        if "text" in suites:
            from mlscale.bench.data_text import run_suite as run_text

            results["text"] = run_text(_with(args, repeats=_repeats(args, "text")), _say)
        if "images" in suites:
            from mlscale.bench.data_images import run_suite

            results["images"] = run_suite(_with(args, repeats=_repeats(args, "images"), batches=args.image_batches,
                                                warmup=2), _say)
    results["total_s"] = time.perf_counter() - started
    results["load_average_at_end"] = _load_average()
    return results


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _default_tf_python() -> str | None:
    candidate = Path(".venv-tf/bin/python")
    return str(candidate) if candidate.exists() else None


def _load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages: how busy the shared cores were around the run."""
    return [round(x, 2) for x in os.getloadavg()]


def _with(args: argparse.Namespace, **values: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **values})


def plot(results: dict[str, Any], path: Path) -> None:
    """One row of panels per suite measured: pipeline (data wait, samples/s), loaders (a panel a Dataset),
    resume (time to first step, and what auto picked and cost)."""
    rows = [suite for suite in SUITES if suite in results]
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 4.4 * len(rows)), squeeze=False)
    for (left, right), suite in zip(axes, rows):
        if suite == "pipeline":
            _plot_pipeline(left, right, results["pipeline"])
        elif suite == "loaders":
            (first, table), *rest = results["loaders"]["data_sets"].items()
            plot_loaders(left, first, table)
            if rest:
                plot_loaders(right, *rest[0])
            else:
                right.axis("off")
        elif suite == "images":
            from mlscale.bench.data_images import plot_images

            plot_images(left, right, results["images"])
        elif suite == "text":
            from mlscale.bench.data_text import plot_text

            plot_text(left, right, results["text"])
        else:
            plot_resume(left, results["resume"])
            if "loaders" in results:
                plot_tuning(right, results["loaders"])
            else:
                right.axis("off")
    fig.suptitle("mlscale bench data (medians; " + ", ".join(rows) + ")")
    fig.tight_layout()
    save_figure(fig, path)


def _plot_pipeline(left: Any, right: Any, section: dict[str, Any]) -> None:
    modes = list(section["modes"])
    table = section["modes"]
    colors = ["grey", "tab:blue", "tab:green"]
    bars = left.bar(modes, [100 * table[m]["data_wait_share"] for m in modes], color=colors)
    left.bar_label(bars, fmt="%.1f%%")
    left.axhline(5, color="black", linestyle="--", linewidth=1, label="goal: 5%")
    left.set_ylabel("data wait, % of step time")
    left.set_title("pipeline: data wait on an expensive per-sample transform", fontsize=9)
    left.legend()
    bars = right.bar(modes, [table[m]["samples_per_s"] for m in modes], color=colors)
    right.bar_label(bars, fmt="%.0f")
    right.set_ylabel("samples/s")
    right.set_title("pipeline: training samples/s", fontsize=9)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "data", results, plot)
    for mode, row in results.get("pipeline", {}).get("modes", {}).items():
        print(f"  pipeline {mode:<14} data wait {row['data_wait_share']:.1%} of the step, {row['samples_per_s']:,.0f} "
              f"samples/s ({row['samples_per_s_vs_naive']:.2f}x naive)")
    for name, table in results.get("loaders", {}).get("data_sets", {}).items():
        anchor = table["anchor"]
        ratios = ", ".join(f"{config} {ratio['vs_anchor_best']:.2f}x" for config, ratio in table["ratios"].items())
        print(f"  loaders {name}: anchor best {anchor['config']} {anchor['batches_per_s']:,.1f} batches/s; {ratios}")
    if "resume" in results:
        resume = results["resume"]
        print(f"  resume: first step after {resume['resume']['first_step_s']:.2f} s vs fresh "
              f"{resume['fresh']['first_step_s']:.2f} s ({resume['resume_over_fresh']:.2f}x)")
    text = results.get("text")
    if text:
        rates = ", ".join(f"{name} {rate:,.0f}" for name, rate in text["tokens_per_s"].items())
        print(f"  text tokens/s: {rates}; first epoch {text['first_vs_plain']:.2f}x plain, later "
              f"{text['later_vs_plain']:.2f}x")
        if "tokenize_pass" in text:
            passes = ", ".join(f"{name} {rate:,.0f}" for name, rate in text["tokenize_pass"]["tokens_per_s"].items())
            print(f"  text tokenizing pass tokens/s: {passes} "
                  f"({text['tokenize_pass']['processes_vs_threads']:.2f}x the threads)")
    images = results.get("images")
    if images:
        rates = ", ".join(f"{name} {rate:,.0f}" for name, rate in images["images_per_s"].items())
        versus = f"{images['vs_torch_best']:.2f}x {images['anchor_torch']}, {images['vs_ceiling']:.2f}x the ceiling" + \
            (f", {images['vs_tf_data']:.2f}x tf.data" if "vs_tf_data" in images else "")
        print(f"  images/s: {rates}; mlscale auto {versus}")
        if "end_to_end" in images:
            trained = images["end_to_end"]
            waits = ", ".join(f"rank {r['rank']} {r['data_wait_share']:.0%}" for r in trained["per_rank"])
            print(f"  --task images on 2 workers (data workers {trained['data_workers']}): "
                  f"{trained['samples_per_s']:,.0f} samples/s, data wait of the step {waits}")
        if "memory_at_10x" in images:
            memory = images["memory_at_10x"]
            print(f"  memory reading tar shards of {memory['images'][1]:,} images: {memory['large_over_small']:.2f}x "
                  f"that of {memory['images'][0]:,}" + (f"; Parquet {memory['parquet_large_over_small']:.2f}x"
                                                          if "parquet_large_over_small" in memory else ""))
        if "s3" in images:
            s3 = images["s3"]
            print(f"  images from S3: first epoch {s3['first']['images_per_s']:,.0f}/s, second "
                  f"{s3['second']['images_per_s']:,.0f}/s ({s3['second_vs_local']:.2f}x local), "
                  f"{s3['objects_fetched']} objects fetched")
    print(f"wrote {json_path} and {png_path}")
    return results
