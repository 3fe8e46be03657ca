"""``mlscale bench serve-lengths``: serving requests of different sequence lengths, padded or grouped.

A BERT-style sentence classifier from ``transformers`` (built from a ``BertConfig``: random weights,
nothing downloaded), called ``model(input_ids=..., attention_mask=...)``, runs in the server's own
``DynamicBatcher`` and torch runtime (no HTTP or client in the way: what is measured is how requests are
put together). ``--clients`` closed-loop clients each send one request at a time, of one row whose
length is drawn uniformly from ``--min-length`` to ``--max-length``. The ways to batch them:

- ``alone``: ``--max-batch-size 1``, every request a model call of its own (no batching);
- ``group``: only requests of one length share a batch (what the server does for a model without an
  attention mask: nothing padded);
- ``pad-longest``: every request padded with 0 to the batch's longest, its attention mask 0 there,
  whatever the mix of lengths;
- ``pad-xS`` for each S of ``--spreads``: the same, but a batch only takes requests whose lengths are
  within S times each other (what the server does for a model that takes an ``attention_mask``, S 1.5).

Requests/s and p50/p99 latency of each, medians of ``--repeats`` (the ways take turns in each repeat);
ratios against ``alone``. Every answer padded to the longest is compared with the same request's answer alone: the
largest differences are recorded (padding must not change an answer beyond float rounding).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlscale.bench.machine import machine_info
from mlscale.bench.report import median_bars, pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, int_at_least

VOCAB = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "serve-lengths")
    p.add_argument("--clients", type=int_at_least(1), default=32, help="closed-loop clients (default: 32)")
    p.add_argument("--requests", type=int_at_least(1), default=512, help="requests per trial (default: 512)")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="trials of each mode (default: 5)")
    p.add_argument("--min-length", type=int_at_least(1), default=8, help="shortest request (default: 8)")
    p.add_argument("--max-length", type=int_at_least(1), default=128, help="longest request (default: 128)")
    p.add_argument("--dim", type=int_at_least(8), default=64, help="the model's hidden size (default: 64)")
    p.add_argument("--layers", type=int_at_least(1), default=2, help="the model's layers (default: 2)")
    p.add_argument("--max-batch-size", type=int_at_least(1), default=32, help="rows per batch (default: 32)")
    p.add_argument("--max-delay-ms", type=float, default=2.0, help="the batcher's wait for batch-mates (default: 2)")
    p.add_argument("--spreads", type=float_list, default=[1.25, 1.5, 2.0],
                   help="longest / shortest request a padded batch may hold, each measured (default: 1.25,1.5,2)")
    p.add_argument("--quick", action="store_true", help="one repeat of 128 requests (a smoke run)")


def float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every spread must be at least 1, got {text!r}")
    return values


def batchings(spreads: list[float]) -> dict[str, Any]:
    """The ways measured, by name (``alone`` runs batches of one: its batching never joins anything)."""
    from mlscale.serve.batching import Batching

    padded = ("input_ids", "attention_mask")
    return {"alone": Batching(), "group": Batching("group"), "pad-longest": Batching("pad", padded, spread=None),
            **{f"pad-x{spread:g}": Batching("pad", padded, spread=spread) for spread in spreads}}


def build_model(dim: int, layers: int) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * dim, max_position_embeddings=512, num_labels=2,
                        attn_implementation="eager")
    return BertForSequenceClassification(config).eval()


def make_requests(count: int, shortest: int, longest: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, count)
    return [{"input_ids": rng.integers(1, VOCAB, (1, n)), "attention_mask": np.ones((1, n), dtype=np.int64)}
            for n in lengths]


async def trial(runtime: Any, mode: str, batching: Any, requests: list[dict[str, np.ndarray]],
                args: argparse.Namespace) -> tuple[dict[str, float], list[np.ndarray]]:
    """One pass over ``requests`` by ``args.clients`` clients; its figures and every answer."""
    from mlscale.serve.batcher import DynamicBatcher
    from mlscale.serve.metrics import ServerMetrics

    batcher = DynamicBatcher(runtime, stats=ServerMetrics().stats_for("bench", "1"),
                             max_batch_size=1 if mode == "alone" else args.max_batch_size,
                             max_delay_s=args.max_delay_ms / 1e3, queue_limit=len(requests), slo_s=None,
                             timeout_s=600.0, batching=batching)
    answers: list[Any] = [None] * len(requests)
    latencies: list[float] = []
    order = iter(range(len(requests)))

    async def client() -> None:
        for index in order:  # shared: each request is sent once, by whichever client is free
            sent = time.perf_counter()
            answers[index] = await batcher.submit(requests[index])
            latencies.append(time.perf_counter() - sent)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall = time.perf_counter() - start
    executions = batcher.executions
    await batcher.close()
    latencies.sort()
    return {"requests_per_s": len(requests) / wall, "p50_ms": 1e3 * latencies[len(latencies) // 2],
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
            "requests_per_batch": len(requests) / executions}, answers


def _difference(answers: list[np.ndarray], alone: list[np.ndarray]) -> dict[str, float]:
    diff = max(float(np.abs(a - b).max()) for a, b in zip(answers, alone))
    rel = max(float((np.abs(a - b) / np.maximum(np.abs(b), 1e-6)).max()) for a, b in zip(answers, alone))
    return {"max_abs_diff": diff, "max_rel_diff": rel}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mlscale.serve.runtime import TorchRuntime

    torch.manual_seed(0)
    runtime = TorchRuntime(build_model(args.dim, args.layers), threads=1)
    requests = make_requests(args.requests, args.min_length, args.max_length)
    ways = batchings(args.spreads)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in ways}
    answers: dict[str, list[np.ndarray]] = {}
    asyncio.run(trial(runtime, "pad-longest", ways["pad-longest"], requests[:32], args))  # warm-up
    for _ in range(args.repeats):
        for mode, batching in ways.items():
            figures, answers[mode] = asyncio.run(trial(runtime, mode, batching, requests, args))
            runs[mode].append(figures)
    medians = {mode: {key: statistics.median(run[key] for run in runs[mode]) for key in runs[mode][0]}
               for mode in ways}
    for mode in ways:
        medians[mode]["throughput_vs_alone"] = medians[mode]["requests_per_s"] / medians["alone"]["requests_per_s"]
        medians[mode]["p50_vs_alone"] = medians[mode]["p50_ms"] / medians["alone"]["p50_ms"]
    return {"benchmark": "serve-lengths", "model": f"BertForSequenceClassification(hidden {args.dim}, "
            f"{args.layers} layers, 4 heads), torch runtime, 1 thread", "clients": args.clients,
            "requests": args.requests, "lengths": [args.min_length, args.max_length],
            "max_batch_size": args.max_batch_size, "max_delay_ms": args.max_delay_ms, "repeats": args.repeats,
            "median": medians, "runs": runs,
            "padded_vs_alone": _difference(answers["pad-longest"], answers["alone"]),
            "grouped_vs_alone": _difference(answers["group"], answers["alone"]), "machine": machine_info()}


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    runs = results["runs"]
    modes = list(runs)
    medians = median_bars(left, modes, [[run["requests_per_s"] for run in runs[mode]] for mode in modes])
    for i, (mode, value) in enumerate(zip(modes, medians)):
        left.text(i, value * 0.2, f"x{results['median'][mode]['throughput_vs_alone']:.2f} vs alone", ha="center",
                  va="center", color="white", fontsize=8)
    left.set(ylabel="requests/s (median, min-max)", title=f"{results['clients']} clients, lengths "
             f"{results['lengths'][0]}-{results['lengths'][1]}")
    median_bars(right, modes, [[run["p50_ms"] for run in runs[mode]] for mode in modes])
    right.set(ylabel="p50 latency (ms)", title="latency per request")
    fig.suptitle(results["model"], fontsize=9)
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.repeats, args.requests = 1, 128
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "serve-lengths", results, plot)
    for mode, row in results["median"].items():
        print(f"{mode}: {row['requests_per_s']:,.0f} requests/s (x{row['throughput_vs_alone']:.2f}), p50 "
              f"{row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, {row['requests_per_batch']:.1f} requests a batch")
    print(f"padded answers vs alone: max abs diff {results['padded_vs_alone']['max_abs_diff']:.2g}")
    print(f"wrote {json_path} and {png_path}")
    return results
