"""``mlscale bench data --suite loaders``: batches/s of a user's map-style Dataset through mlscale's
loaders against a plain ``torch.utils.data.DataLoader`` on the same Dataset and collate.

mlscale's side is what the trainer builds for ``--data-workers N``: ``ShardLoader`` (N = 0: items read
and collated in the training process) or ``DatasetLoader`` (N >= 1: DataLoader worker processes fed by
mlscale's batch plan, which keeps the exact resume position), and ``auto`` (``autotune_workers``: each
candidate timed on a few batches, the fastest kept; its tuning time reported apart, since a run pays it
once at start). The anchor is ``DataLoader(dataset, batch_size, shuffle=True, num_workers=n,
collate_fn=the same collate, persistent_workers, prefetch_factor=2)`` at every n measured, the best one
(by median) reported as "the anchor in its best configuration". Each measurement makes a new loader,
takes ``warmup`` batches (worker start-up included there, and reported as the time to the first batch),
then times ``batches`` batches; nothing is done with a batch, so this is the loader's ceiling, not a
training step's data wait. Configurations run in turn within a repeat, in reversed order every other
repeat; medians over repeats; a ratio is the median of per-repeat ratios (both sides of a ratio ran
seconds apart on the same machine state), and the fastest runs' ratio is reported too: on shared cores
another job's load slows some runs down (never up), splitting a configuration's runs in two.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

WORKERS = (0, 1, 2)  # mlscale's fixed settings, as the issue asks; auto picks beyond them on a big host


def anchor_workers() -> list[int]:
    """The num_workers the anchor is measured at: 0, 1, 2, then 4, 8, 16... up to the cores (its best of them
    is the anchor: on a 16-core host, 2 would not be its best configuration)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [*WORKERS, *[n for n in (4, 8, 16, 32) if n <= cores]]


class _Timed:
    """One loader, opened: ``next`` gives a batch, ``close`` stops its worker processes."""

    def __init__(self, batches: Iterator[Any], close: Callable[[], None]) -> None:
        self.batches, self.close = batches, close

    def next(self) -> Any:
        return next(self.batches)


def _forever(loader: Any) -> Iterator[Any]:
    """A DataLoader's batches epoch after epoch (mlscale's loaders do the same by themselves)."""
    while True:
        yield from loader


def _anchor(dataset: Any, collate: Callable[[list[Any]], Any], workers: int, batch_size: int) -> _Timed:
    """The plain DataLoader a user writes: shuffled, the same collate, persistent workers, prefetch 2."""
    from torch.utils.data import DataLoader

    loader: Any = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, collate_fn=collate,
                             persistent_workers=workers > 0, prefetch_factor=2 if workers else None, drop_last=True)
    batches = _forever(loader)

    def close() -> None:
        nonlocal loader, batches
        batches.close()
        loader._iterator = None  # a persistent DataLoader keeps its iterator: its workers stop with it
        loader = batches = None

    return _Timed(batches, close)


def _mlscale(data: Any, workers: int | str, batch_size: int, tuning: dict[str, Any]) -> _Timed:
    """What the trainer builds for ``--data-workers`` ``workers`` on one worker (rank 0 of 1); for
    ``auto`` the tuning is run first and what it picked and took goes into ``tuning``."""
    from mlscale.data.loader import ShardLoader
    from mlscale.data.pipeline import DatasetLoader, autotune_workers

    def make(n: int) -> DatasetLoader:
        return DatasetLoader(data, rank=0, world=1, step_batch=batch_size, seed=0, workers=n, prefetch=2)

    if workers == "auto":
        start = time.perf_counter()
        picked, timings = autotune_workers(make)
        tuning.update(picked=picked, tuning_s=time.perf_counter() - start,
                      tuning_ms_per_batch={str(n): ms for n, ms in timings.items()})
        workers = picked
    if workers == 0 and "picked" not in tuning:
        loader: Any = ShardLoader(data, rank=0, world=1, step_batch=batch_size, seed=0)
        return _Timed(loader, lambda: None)
    loader = make(int(workers))
    return _Timed(loader, loader.close)


def measure(open_loader: Callable[[], _Timed], warmup: int, batches: int) -> dict[str, float]:
    """Batches/s over ``batches`` batches after ``warmup``; the seconds from making the loader to its
    first batch (worker start-up)."""
    start = time.perf_counter()
    loader = open_loader()
    try:
        loader.next()
        first = time.perf_counter() - start
        for _ in range(warmup - 1):
            loader.next()
        start = time.perf_counter()
        for _ in range(batches):
            loader.next()
        elapsed = time.perf_counter() - start
    finally:
        loader.close()
    return {"batches_per_s": batches / elapsed, "first_batch_s": first}


def data_sets(args: argparse.Namespace, loops: int) -> dict[str, dict[str, Any]]:
    """The two user Datasets, each big enough for one run's batches within one epoch."""
    from mlscale.bench.data_sets import SlowItems, TextItems, text_collate
    from mlscale.data.collate import stack

    size = args.batch_size * (args.warmup + args.batches + 2)
    return {
        "slow_items": {"dataset": SlowItems(size, loops), "collate": stack,
                       "describe": f"{size:,} items of 32 floats + a label, {args.item_ms:g} ms of pure-Python work "
                                   f"per item ({loops:,} loops), stacked"},
        "text": {"dataset": TextItems(size), "collate": text_collate(),
                 "describe": f"{size:,} sentences of 8-128 words tokenized in __getitem__ (a dict lookup per word), "
                             "PadCollate(mask='attention_mask'): padded to each batch's longest"},
    }


def item_ms(dataset: Any, items: int = 300) -> float:
    """The median cost of one ``__getitem__`` here, in ms: what the items really cost on this run."""
    times = []
    for index in range(items):
        start = time.perf_counter()
        dataset[index % len(dataset)]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_loaders(args: argparse.Namespace) -> dict[str, Any]:
    """The loaders section of ``data.json``."""
    from mlscale.bench.data_sets import loops_for

    loops = loops_for(args.item_ms)
    section: dict[str, Any] = {
        "how": (f"batch {args.batch_size}, {args.warmup} warm-up batches (worker start-up included) then "
                f"{args.batches} timed batches per measurement, a new loader each time; {args.repeats} repeats, "
                "configurations interleaved (reversed every other repeat); medians; ratios are medians of "
                "per-repeat ratios (fastest_vs_anchor_fastest: the fastest run of each, for when other load on "
                "the shared cores splits the runs in two). mlscale N: ShardLoader (N=0) or DatasetLoader "
                "(N>=1), as the trainer builds for --data-workers N; mlscale auto: autotune_workers then "
                "DatasetLoader with its pick; torch N: DataLoader(shuffle=True, num_workers=N, the same "
                "collate, persistent_workers, prefetch_factor=2). The consuming process does nothing with a "
                "batch: the loaders' ceiling, not a training step's wait"),
        "batch_size": args.batch_size, "warmup": args.warmup, "batches": args.batches, "repeats": args.repeats,
        "item_loops": loops, "data_sets": {},
    }
    for name, spec in data_sets(args, loops).items():
        section["data_sets"][name] = _measure_data_set(name, spec, args)
    return section


def _openers(spec: dict[str, Any], batch_size: int) -> dict[str, Callable[[dict[str, Any]], _Timed]]:
    """Each configuration's loader maker, by name, in the order measured: mlscale's, then the anchor's."""
    import torch

    from mlscale.data.dataset import MapData

    data = MapData(spec["dataset"], spec["collate"]).to(torch.float32)  # as the trainer reads it
    openers: dict[str, Callable[[dict[str, Any]], _Timed]] = {}
    for n in WORKERS:
        openers[f"mlscale {n}"] = lambda tuning, n=n: _mlscale(data, n, batch_size, tuning)
    openers["mlscale auto"] = lambda tuning: _mlscale(data, "auto", batch_size, tuning)
    for n in anchor_workers():
        openers[f"torch {n}"] = lambda tuning, n=n: _anchor(spec["dataset"], spec["collate"], n, batch_size)
    return openers


def _measure_data_set(name: str, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration on one Dataset, ``args.repeats`` times, interleaved; summarized."""
    openers = _openers(spec, args.batch_size)
    runs: dict[str, list[dict[str, Any]]] = {config: [] for config in openers}
    for repeat in range(args.repeats):
        for config in openers if repeat % 2 == 0 else list(openers)[::-1]:
            tuning: dict[str, Any] = {}
            run = measure(functools.partial(openers[config], tuning), args.warmup, args.batches)
            if tuning:  # the loader's own start-up, without the tuning before it (reported apart)
                run["first_batch_s"] -= tuning["tuning_s"]
            runs[config].append({**run, **tuning})
            picked = f" (picked {tuning['picked']}, tuned in {tuning['tuning_s']:.2f} s)" if tuning else ""
            print(f"loaders {name:<10} repeat {repeat + 1}/{args.repeats}  {config:<12} "
                  f"{run['batches_per_s']:7.1f} batches/s{picked}", file=sys.stderr, flush=True)
    return summarize(runs, spec["describe"], item_ms(spec["dataset"]))


def summarize(runs: dict[str, list[dict[str, Any]]], describe: str, cost_ms: float) -> dict[str, Any]:
    """Medians by configuration, the anchor's best configuration, and mlscale's ratios to it."""
    configs = {}
    for config, group in runs.items():
        row: dict[str, Any] = {key: statistics.median(r[key] for r in group)
                               for key in ("batches_per_s", "first_batch_s")}
        row["min_batches_per_s"] = min(r["batches_per_s"] for r in group)
        row["max_batches_per_s"] = max(r["batches_per_s"] for r in group)
        if "picked" in group[0]:
            row["picked"] = [r["picked"] for r in group]
            row["tuning_s"] = statistics.median(r["tuning_s"] for r in group)
        row["runs"] = group
        configs[config] = row
    anchors = [c for c in configs if c.startswith("torch")]
    best = max(anchors, key=lambda c: configs[c]["batches_per_s"])

    def ratio(config: str, other: str) -> float:
        return statistics.median(a["batches_per_s"] / b["batches_per_s"] for a, b in zip(runs[config], runs[other]))

    ratios = {}
    for config in configs:
        if config.startswith("mlscale"):
            same = f"torch {config.split()[1]}"
            ratios[config] = {"vs_anchor_best": ratio(config, best),
                              **({"vs_torch_same_workers": ratio(config, same)} if same in configs else {}),
                              # the fastest run of each: what each does when the shared cores are free
                              "fastest_vs_anchor_fastest": configs[config]["max_batches_per_s"]
                              / configs[best]["max_batches_per_s"]}
    return {"describe": describe, "item_ms_measured": cost_ms, "configs": configs,
            "anchor": {"config": best, "batches_per_s": configs[best]["batches_per_s"]}, "ratios": ratios}


def plot_loaders(ax: Any, name: str, table: dict[str, Any]) -> None:
    """One data set: a bar per configuration (median, min-max), mlscale's labelled with its ratio to the
    anchor's best, the anchor's best as a dashed line."""
    configs = table["configs"]
    names = list(configs)
    medians = [configs[c]["batches_per_s"] for c in names]
    errors = [[m - configs[c]["min_batches_per_s"] for m, c in zip(medians, names)],
              [configs[c]["max_batches_per_s"] - m for m, c in zip(medians, names)]]
    colors = ["tab:blue" if c.startswith("mlscale") else "tab:gray" for c in names]
    best = table["anchor"]["config"]
    labels = []
    for c in names:
        if c == "mlscale auto":
            picks = sorted(set(configs[c].get("picked", [])))
            labels.append(f"mlscale auto\n(picked {','.join(map(str, picks))})")
        else:
            labels.append(c.replace(" ", "\n", 1) + (" (best)" if c == best else ""))
    bars = ax.bar(range(len(names)), medians, yerr=errors, capsize=3, color=colors)
    texts = [f"{m:.0f}\n{table['ratios'][c]['vs_anchor_best']:.2f}x" if c in table["ratios"] else f"{m:.0f}"
             for c, m in zip(names, medians)]
    ax.bar_label(bars, texts, label_type="center", color="white", fontsize=8, fontweight="bold")
    ax.axhline(table["anchor"]["batches_per_s"], color="black", linestyle="--", linewidth=1,
               label=f"anchor best ({best})")
    ax.set_xticks(range(len(names)), labels, fontsize=7)
    ax.set_ylabel("batches/s (median, min-max)")
    ax.set_title(f"{name}: {table['item_ms_measured']:.3f} ms/item; mlscale/anchor-best in bars", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def plot_tuning(ax: Any, section: dict[str, Any]) -> None:
    """``--data-workers auto`` on each Dataset: the ms per batch it measured for each candidate (medians
    over repeats) and, in the title, what it picked and how long the tuning took."""
    names = list(section["data_sets"])
    width = 0.8 / max(1, len(names))
    notes = []
    for i, name in enumerate(names):
        auto = section["data_sets"][name]["configs"]["mlscale auto"]
        candidates = list(auto["runs"][0]["tuning_ms_per_batch"])
        ms = [statistics.median(r["tuning_ms_per_batch"][c] for r in auto["runs"]) for c in candidates]
        bars = ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(candidates))], ms, width,
                      label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(candidates)), [f"{c} workers" for c in candidates])
        picks = ",".join(map(str, sorted(set(auto["picked"]))))
        notes.append(f"{name}: picked {picks} in {auto['tuning_s']:.2f} s")
    ax.set_ylabel("ms per batch while tuning (median)")
    ax.set_title("--data-workers auto: " + "; ".join(notes), fontsize=9)
    ax.legend(fontsize=7)


__all__ = ["measure", "plot_loaders", "plot_tuning", "run_loaders", "summarize"]
