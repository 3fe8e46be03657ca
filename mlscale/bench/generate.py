"""``mlscale bench generate``: text generation under Poisson load, continuous batching against its anchors.

A tiny Llama (``LlamaForCausalLM`` from a ``LlamaConfig``: random weights, float32, CPU, nothing
downloaded) answers the same seeded requests, prompts and outputs of varied lengths, arriving as a Poisson
process at several rates, through each of the systems of ``generate_systems``: one request at a time
through ``generate`` (the floor), static batching (a dynamic batcher's window, then ``generate`` on the
left-padded batch), transformers' own continuous batching, and mlscale (``mlscale serve``, asked through its
streaming endpoint; ``--mlscale-via engine``: its engine in this process). Every request is greedy
and runs to exactly its own max_tokens (no end-of-sequence token), so all systems do the same work.

Measured on the client as vLLM's ``benchmark_serving`` defines it, from each request's intended send time
(open loop: a slow system does not slow the arrivals down): TTFT (to the first token), TPOT (the time after
the first token divided by the tokens after it), ITL (the gaps between streamed chunks), E2E latency,
and goodput = requests meeting every SLO per second of the run (first arrival to last token). The SLOs
are DistServe's "SLO scale": ``--slo-scale`` times the p50 TTFT and TPOT of the floor running requests of
this workload alone, on this machine, at the start of the run; the rates likewise are ``--loads`` times
the floor's capacity (1 / its mean solo latency), so that the figures mean the same on a slower machine.

The shared-prefix workload: requests whose prompts share ``--prefix-tokens`` tokens, then a few of their
own, through the engine with prefix caching on and off: p50 TTFT of each.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlscale.bench import generate_systems as systems
from mlscale.bench.generate_server import VOCAB, build_model, register, run_http, serving
from mlscale.bench.generate_systems import Request, TokenTimes, run_engine, solo
from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.bench.serve_lengths import float_list
from mlscale.cli.parsers import add_out_option, int_at_least, int_list

SYSTEMS = {"floor": "one at a time through generate", "static": "static batching (window, then padded generate)",
           "hf_cb": "transformers continuous batching", "mlscale": "mlscale GenerationEngine"}
TRANSPORTS = {"server": "mlscale serve (torch runtime, 1 worker): POST /v1/completions with stream: true, token ids "
                         "in and out, one connection per request",
              "engine": "in process: GenerationEngine.generate's stream (no HTTP)"}
TARGETS = {"goodput_vs_static": 3.0, "goodput_vs_hf_cb": 1.0, "prefix_ttft_with_vs_without": 0.5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "generate")
    p.add_argument("--requests", type=int_at_least(2), default=64, help="requests per rate (default: 64)")
    p.add_argument("--loads", type=float_list, default=[1.0, 2.0, 4.0, 8.0],
                   help="offered rates, in multiples of the floor's capacity (default: 1,2,4,8)")
    p.add_argument("--prompt-lengths", type=int_list(1), default=[16, 256], help="shortest,longest prompt "
                   "(default: 16,256)")
    p.add_argument("--output-lengths", type=int_list(1), default=[16, 128], help="fewest,most new tokens "
                   "(default: 16,128)")
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLOs: this times the floor's solo p50 TTFT "
                   "and TPOT (default: 5)")
    p.add_argument("--window-ms", type=float, default=5.0, help="static batching's wait for batch-mates "
                   "(default: 5, its best of 5 and 20 here: against SLOs of tens of ms a longer wait costs more "
                   "than it gathers)")
    p.add_argument("--max-batch", type=int_at_least(1), default=32, help="sequences a batch or step holds, "
                   "every system (default: 32)")
    p.add_argument("--max-batch-tokens", type=int_at_least(16), default=256, help="tokens a continuous-batching "
                   "step computes (default: 256)")
    p.add_argument("--kv-cache-mb", type=float, default=64.0, help="KV cache of the continuous batchers (default: 64)")
    p.add_argument("--prefix-tokens", type=int_at_least(1), default=768, help="the shared prefix (default: 768)")
    p.add_argument("--prefix-requests", type=int_at_least(2), default=32, help="requests of the shared-prefix "
                   "workload (default: 32)")
    p.add_argument("--layers", type=int_at_least(1), default=4, help="the Llama's layers (default: 4)")
    p.add_argument("--hidden", type=int_at_least(8), default=128, help="the Llama's hidden size (default: 128)")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads (default: 1)")
    p.add_argument("--mlscale-via", choices=sorted(TRANSPORTS), default="server", help="mlscale measured through "
                   "mlscale serve's streaming endpoint, or its engine in this process (default: server)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a tiny model and a few short requests (a smoke run)")


def workload(count: int, prompt_lengths: list[int], output_lengths: list[int], seed: int,
             prefix: list[int] | None = None) -> list[Request]:
    """Requests arriving as a Poisson process of rate 1 (scaled per rate by ``at_rate``); with ``prefix``,
    each prompt is it followed by ``prompt_lengths`` tokens of its own."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, count)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    lengths = rng.integers(prompt_lengths[0], prompt_lengths[1] + 1, count)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in lengths]
    outputs = rng.integers(output_lengths[0], output_lengths[1] + 1, count).tolist()
    return [Request(float(t), (prefix or []) + p, int(n)) for t, p, n in zip(arrivals, prompts, outputs)]


def at_rate(requests: list[Request], rate: float) -> list[Request]:
    return [Request(r.arrival_s / rate, r.prompt, r.max_tokens) for r in requests]


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99))}


def summarize(requests: list[Request], times: list[TokenTimes], slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """vLLM's benchmark_serving figures of one run, goodput at the two SLOs."""
    done = [(r, t) for r, t in zip(requests, times) if t]
    ttft = [t[0] - r.arrival_s for r, t in done]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for _, t in done if len(t) > 1]
    itl = [b - a for _, t in done for a, b in itertools.pairwise(t) if b > a]  # between chunks
    good = sum(t[0] - r.arrival_s <= slo_ttft_s and (len(t) < 2 or (t[-1] - t[0]) / (len(t) - 1) <= slo_tpot_s)
               for r, t in done)
    duration = max((t[-1] for _, t in done), default=requests[-1].arrival_s) or 1.0
    return {"completed": len(done), "failed": len(requests) - len(done), "duration_s": duration,
            "request_throughput": len(done) / duration, "output_throughput": sum(len(t) for _, t in done) / duration,
            "goodput": good / duration, "good": good, "ttft_ms": _spread(ttft), "tpot_ms": _spread(tpot),
            "itl_ms": _spread(itl), "e2el_ms": _spread([t[-1] - r.arrival_s for r, t in done])}


def calibrate(model: Any, requests: list[Request], scale: float) -> dict[str, float]:
    """The floor alone on the first requests: the SLOs (``scale`` times its p50 TTFT and TPOT) and its
    capacity (1 / mean latency)."""
    solo(model, requests[0])  # warm-up
    runs = [solo(model, r) for r in requests[:8]]
    ttft = statistics.median(t[0] for t in runs)
    tpot = statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in runs if len(t) > 1)
    return {"solo_p50_ttft_ms": 1e3 * ttft, "solo_p50_tpot_ms": 1e3 * tpot,
            "floor_capacity_rps": 1 / statistics.mean(t[-1] for t in runs), "slo_scale": scale,
            "slo_ttft_ms": 1e3 * scale * ttft, "slo_tpot_ms": 1e3 * scale * tpot}


Runner = Callable[[list[Request]], list[TokenTimes]]


def runners(model: Any, args: argparse.Namespace, server: str | None) -> dict[str, Runner]:
    """Each system as a function of the requests; mlscale through ``server`` (its URL) when there is one."""
    sizes = {"max_batch": args.max_batch, "max_batch_tokens": args.max_batch_tokens, "kv_cache_mb": args.kv_cache_mb}
    return {"floor": lambda requests: systems.run_floor(model, requests),
            "static": lambda requests: systems.run_static(model, requests, args.window_ms / 1e3, args.max_batch),
            "hf_cb": lambda requests: systems.run_hf_cb(model, requests, **sizes),
            "mlscale": (lambda requests: run_http(server, requests)) if server is not None
            else (lambda requests: systems.run_engine(model, requests, **sizes))}


@contextlib.contextmanager
def mlscale_server(model: Any, args: argparse.Namespace, context: int) -> Iterator[str | None]:
    """``mlscale serve`` of the model, registered in a scratch registry (None with --mlscale-via engine)."""
    if args.mlscale_via == "engine":
        yield None
        return
    engine = {"max_batch": args.max_batch, "max_batch_tokens": args.max_batch_tokens, "kv_cache_mb": args.kv_cache_mb,
              "queue_limit": max(args.requests, 256)}
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as scratch:
        options = {"layers": args.layers, "hidden": args.hidden, "context": context}
        with serving(register(model, options, Path(scratch)), engine, args.threads) as base:
            yield base


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_load(run: dict[str, Runner], requests: list[Request], slo: dict[str, float], load: float) -> dict[str, Any]:
    """Every system on the requests at ``load`` times the floor's capacity."""
    rate = load * slo["floor_capacity_rps"]
    timed = at_rate(requests, rate)
    figures = {name: summarize(timed, system(timed), slo["slo_ttft_ms"] / 1e3, slo["slo_tpot_ms"] / 1e3)
               for name, system in run.items()}
    return {"load": load, "requests_per_s": rate, "systems": figures}


def run_prefix(model: Any, args: argparse.Namespace, rate: float, slo: dict[str, float]) -> dict[str, Any]:
    """The shared-prefix workload through the engine, prefix caching on then off."""
    prefix = np.random.default_rng(args.seed + 1).integers(1, VOCAB, args.prefix_tokens).tolist()
    requests = at_rate(workload(args.prefix_requests, args.suffix_lengths, args.prefix_outputs, args.seed + 2, prefix),
                       rate)
    sizes = {"max_batch": args.max_batch, "max_batch_tokens": args.max_batch_tokens, "kv_cache_mb": args.kv_cache_mb}
    figures = {key: summarize(requests, run_engine(model, requests, prefix_caching=on, **sizes),
                              slo["slo_ttft_ms"] / 1e3, slo["slo_tpot_ms"] / 1e3)
               for key, on in (("with_cache", True), ("without_cache", False))}
    return {"requests": args.prefix_requests, "prefix_tokens": args.prefix_tokens, "own_tokens": args.suffix_lengths,
            "output_tokens": args.prefix_outputs, "requests_per_s": rate, **figures,
            "p50_ttft_with_vs_without": _ratio(figures["with_cache"]["ttft_ms"]["p50"],
                                               figures["without_cache"]["ttft_ms"]["p50"])}


def _target(key: str, value: float | None, mlscale: float) -> dict[str, Any]:
    """A ratio against its target; a goodput ratio over an anchor that met no SLO is None (met if mlscale did)."""
    if value is None:
        return {"ratio": None, "target": TARGETS[key], "met": mlscale > 0}
    met = value <= TARGETS[key] if key.startswith("prefix") else value >= TARGETS[key]
    return {"ratio": value, "target": TARGETS[key], "met": met}


def targets(loads: list[dict[str, Any]], prefix: dict[str, Any]) -> dict[str, Any]:
    """The three ratios, goodput's at each system's best rate (the most it serves within the SLOs)."""
    best = {name: max(load["systems"][name]["goodput"] for load in loads) for name in SYSTEMS}
    return {"best_goodput": best,
            "goodput_vs_static": _target("goodput_vs_static", _ratio(best["mlscale"], best["static"]),
                                         best["mlscale"]),
            "goodput_vs_hf_cb": _target("goodput_vs_hf_cb", _ratio(best["mlscale"], best["hf_cb"]), best["mlscale"]),
            "prefix_ttft_with_vs_without": _target("prefix_ttft_with_vs_without",
                                                   prefix["p50_ttft_with_vs_without"], 1.0)}


def _quick(args: argparse.Namespace) -> None:
    args.requests, args.loads, args.layers, args.hidden = 8, [4.0], 2, 32
    args.prompt_lengths, args.output_lengths, args.prefix_tokens, args.prefix_requests = [4, 16], [4, 8], 64, 6
    args.max_batch, args.window_ms, args.kv_cache_mb = 8, 5.0, 4.0


def _model_text(model: Any, args: argparse.Namespace) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (f"LlamaForCausalLM from LlamaConfig({args.layers} layers, hidden {args.hidden}, 4 heads, 2 KV heads, "
            f"vocab {VOCAB}), {params / 1e6:.2f}M parameters, float32, CPU, {args.threads} torch thread(s)")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()
    args.suffix_lengths, args.prefix_outputs = ([4, 8], [4, 4]) if args.quick else ([8, 32], [8, 16])
    context = max(args.prompt_lengths[1] + args.output_lengths[1],
                  args.prefix_tokens + args.suffix_lengths[1] + args.prefix_outputs[1])
    model = build_model(args.layers, args.hidden, context)
    shape = (args.prompt_lengths, args.output_lengths)
    workloads = [workload(args.requests, *shape, args.seed + i) for i in range(len(args.loads))]  # no prompt
    slo = calibrate(model, workloads[0], args.slo_scale)  # seen twice by a server's prefix cache
    with mlscale_server(model, args, context) as server:
        run = runners(model, args, server)
        for system in run.values():  # warm-up: first calls, thread start, allocations
            system(at_rate(workload(2, *shape, args.seed - 1), 100.0))
        loads = [run_load(run, requests, slo, load) for requests, load in zip(workloads, args.loads)]
    prefix = run_prefix(model, args, min(args.loads) * slo["floor_capacity_rps"], slo)
    return {"benchmark": "generate", "model": _model_text(model, args), "systems": SYSTEMS,
            "mlscale_transport": TRANSPORTS[args.mlscale_via],
            "prefix_transport": "in process: GenerationEngine.generate's stream, prefix caching on and off",
            "measured": "on the client, vLLM benchmark_serving's definitions, from each request's intended send time; "
                        "floor and static stream through a transformers streamer (a token's time is when generate "
                        "made it; without it TTFT would be the completion time)",
            "workload": {"requests": args.requests, "arrivals": "Poisson", "prompt_lengths": args.prompt_lengths,
                         "output_lengths": args.output_lengths, "greedy": True, "ignore_eos": True,
                         "seed": args.seed},
            "settings": {"window_ms": args.window_ms, "max_batch": args.max_batch,
                         "max_batch_tokens": args.max_batch_tokens, "kv_cache_mb": args.kv_cache_mb},
            "slo": slo, "loads": loads, "prefix": prefix, "targets": targets(loads, prefix),
            "machine": {**machine_info(), "transformers": transformers.__version__,
                        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()}}


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    rates = [load["requests_per_s"] for load in results["loads"]]
    panels = ((axes[0][0], lambda f: f["goodput"], "goodput (requests/s within both SLOs)"),
              (axes[0][1], lambda f: f["ttft_ms"]["p50"], "p50 TTFT (ms)"),
              (axes[1][0], lambda f: f["tpot_ms"]["p50"], "p50 TPOT (ms)"))
    for ax, value, label in panels:
        for name in results["systems"]:
            ax.plot(rates, [value(load["systems"][name]) for load in results["loads"]], marker="o", label=name)
        ax.set(xlabel="offered requests/s (Poisson)", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    axes[0][1].axhline(results["slo"]["slo_ttft_ms"], color="gray", linestyle=":", label="SLO")
    axes[1][0].axhline(results["slo"]["slo_tpot_ms"], color="gray", linestyle=":", label="SLO")
    for ax in (axes[0][1], axes[1][0]):
        ax.set_yscale("log")
    prefix = results["prefix"]
    bars = [prefix["with_cache"]["ttft_ms"]["p50"] or 0, prefix["without_cache"]["ttft_ms"]["p50"] or 0]
    axes[1][1].bar(["prefix cache on", "off"], bars, color=["tab:blue", "tab:gray"])
    axes[1][1].set(ylabel="p50 TTFT (ms)", title=f"{prefix['prefix_tokens']} shared prompt tokens, "
                   f"x{prefix['p50_ttft_with_vs_without'] or float('nan'):.2f} with the cache")
    fig.suptitle(results["model"], fontsize=9)
    save_figure(fig, path)


def _print(results: dict[str, Any]) -> None:
    slo = results["slo"]
    print(f"SLOs: TTFT <= {slo['slo_ttft_ms']:.0f} ms, TPOT <= {slo['slo_tpot_ms']:.1f} ms "
          f"({slo['slo_scale']:g}x the floor alone); floor capacity {slo['floor_capacity_rps']:.2f} requests/s")
    for load in results["loads"]:
        for name, f in load["systems"].items():
            p50 = {key: "-" if f[key]["p50"] is None else f"{f[key]['p50']:.1f}"
                   for key in ("ttft_ms", "tpot_ms", "itl_ms")}
            print(f"{load['requests_per_s']:6.2f} req/s {name:8s} goodput {f['goodput']:6.2f}/s, "
                  f"{f['output_throughput']:7.0f} tok/s, p50 TTFT {p50['ttft_ms']:>8s} ms, "
                  f"p50 TPOT {p50['tpot_ms']:>6s} ms, p50 ITL {p50['itl_ms']:>6s} ms, {f['failed']} failed")
    for key, target in results["targets"].items():
        if key != "best_goodput":
            ratio = "n/a" if target["ratio"] is None else f"{target['ratio']:.2f}"
            print(f"{key}: {ratio} (target {target['target']:g}, {'met' if target['met'] else 'NOT met'})")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        _quick(args)
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "generate", results, plot)
    _print(results)
    print(f"wrote {json_path} and {png_path}")
    return results
