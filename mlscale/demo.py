"""``make demo``: the main job end to end on the embedded defaults.

Train the digits MLP on 2 local data-parallel workers (progress bar), evaluate and plot; register the
model in the local registry, promote it to Production, export it to ONNX (checked against PyTorch);
serve ``models:/digits-demo/Production`` and find its goodput at a 50 ms p99 SLO under open-loop load
of distinct inputs with the response cache off, searched until a trial misses the SLO; then measure
the cache on its own (repeated inputs, cache on), labelled as such; print one summary table.
``--quick``: the same steps, shorter (5 epochs, serving trials of 0.5 s): rougher figures, in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlscale import TrainConfig, fit
from mlscale.bench import serve as bench
from mlscale.errors import MlscaleError
from mlscale.export import export_version
from mlscale.registry import Registry, register_run
from mlscale.registry.models import task_of
from mlscale.rundir import RunDir
from mlscale.train.plot import plot_run

REGISTRY = "mlscale-registry"
MODEL_NAME = "digits-demo"
SLO_MS = 50.0
DISTINCT_BODIES = 4000  # inputs cycle only every 4,000 requests; with the cache off, none is answered from it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlscale.demo", description="make demo: train, register, "
                                     "export and serve the digits model, with one summary table")
    parser.add_argument("--quick", action="store_true", help="5 training epochs and 0.5 s serving trials "
                        "instead of 20 and 1.5 s: the same steps in a fraction of the time, rougher figures")
    quick = parser.parse_args(argv).quick
    started = time.time()
    run_dir = f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"  # a new folder: a registered version's
    # source run is never overwritten by a later demo
    print("mlscale demo: training the digits MLP on 2 data-parallel workers (gloo on CPU, nccl on CUDA)",
          file=sys.stderr)
    try:
        report = fit(TrainConfig(task="digits", workers=2, epochs=5 if quick else 20, batch_size=32, lr=0.05,
                                 checkpoint_every=100, run_dir=run_dir))
    except MlscaleError as exc:
        print(f"mlscale demo: {exc}", file=sys.stderr)
        return exc.exit_code
    plot = plot_run(run_dir)
    print(f"mlscale demo: registering in {REGISTRY}/, promoting to Production, exporting to ONNX", file=sys.stderr)
    registry = Registry(REGISTRY)
    version = register_run(registry, run_dir, MODEL_NAME, description="make demo")
    registry.set_stage(MODEL_NAME, version.version, "Production", archive_existing=True)
    _, parity = export_version(registry, f"models:/{MODEL_NAME}/Production")
    print(f"mlscale demo: serving it; goodput at p99 <= {SLO_MS:g} ms on distinct inputs, cache off (open-loop "
          "load, searched until the SLO fails)", file=sys.stderr)
    serving = measure_serving(registry, Path(run_dir), trial_s=0.5 if quick else 1.5)
    cache = serving["cache"]
    rows = [
        ("eval accuracy", f"{report['eval']['accuracy']:.2%} on the held-out digits"),
        ("training throughput", f"{report['samples_per_s']:,.0f} samples/s ({report['world_size']} workers)"),
        ("final training loss", f"{report['final_loss']:.4f} after {report['steps']} steps"),
        ("registered", f"{version.uri} (stage Production; `mlscale models show {MODEL_NAME}`)"),
        ("ONNX export", f"max abs error vs PyTorch {parity.max_abs_err:.1e} on {parity.samples} held-out digits"),
        ("serving goodput", f"{serving['goodput']:,.0f} requests/s at p99 <= {SLO_MS:g} ms, distinct inputs, cache "
                            f"off (p99 there {serving['p99_ms']:.1f} ms, p50 {serving['p50_ms']:.1f} ms; "
                            f"{serving['failed_at']:,.0f}/s missed the SLO)"),
        ("cache hits (separate)", f"{cache['hit_ratio']:.1%} hits on {cache['distinct']} repeated inputs at "
                                  f"{cache['rate']:,.0f} requests/s: p50 {cache['p50_ms']:.2f} ms vs "
                                  f"{serving['p50_at_cache_rate_ms']:.2f} ms uncached"),
        ("plots", f"{plot}, {serving['plot']}"),
        ("run directory", f"{run_dir} (report.json, metrics.jsonl, checkpoints/, final/, serving.json)"),
        ("demo wall time", f"{time.time() - started:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    print("mlscale demo summary")
    print("-" * (width + 60))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def distinct_rows(rows: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """``count`` different inputs: held-out digits with a little noise, so no two requests are equal."""
    rng = np.random.default_rng(seed)
    picked = rows[rng.integers(0, len(rows), count)]
    return (picked + rng.uniform(0, 1e-3, picked.shape)).astype(np.float32)


def measure_serving(registry: Registry, run_dir: Path, trial_s: float = 1.5) -> dict[str, Any]:
    """Serve the Production model in its own process: the goodput search with the cache off, then the
    cache on its own."""
    uri = f"models:/{MODEL_NAME}/Production"
    held_out = task_of(registry.resolve(uri).config).eval.inputs.numpy()
    args = argparse.Namespace(max_batch_size=64, max_delay_ms=2.0, slo_ms=SLO_MS, duration_s=trial_s,
                              warmup_s=trial_s / 3, bisect=2, start_rate=400.0, rows_per_request=1)
    model = {"uri": uri, "registry": REGISTRY, "rows": distinct_rows(held_out, DISTINCT_BODIES)}
    server = bench.start_server("mlscale", model, args, cache_mb=0.0)
    try:
        goodput, trials = bench.find_goodput(server, args, lambda *_: None)
        cache_rate = max(400.0, goodput / 4)
        uncached = bench.trial(server, cache_rate, args)
    finally:
        server.stop()
    repeated = {**model, "rows": held_out[:50]}
    server = bench.start_server("mlscale", repeated, args, cache_mb=64.0)
    try:
        bench.trial(server, cache_rate, args)  # fills the cache
        cached = bench.trial(server, cache_rate, args)
        hits = _metric_sum(server, "mlscale_cache_num_hits_per_model_total")
        misses = _metric_sum(server, "mlscale_cache_num_misses_per_model_total")
    finally:
        server.stop()
    met = [t for t in trials if t["meets_slo"]]
    at_goodput = max(met, key=lambda t: t["offered_rate"], default=trials[0])
    failed = min((t["offered_rate"] for t in trials if not t["meets_slo"]), default=float("nan"))
    plot = RunDir(run_dir).serving_plot_path
    bench.plot({"slo_ms": SLO_MS, "models": {f"{MODEL_NAME} (distinct inputs, cache off)": {"systems": {
        "mlscale": {"goodput": goodput, "trials": trials}}}}}, plot)
    cache = {"rate": cache_rate, "distinct": len(repeated["rows"]), "p50_ms": cached["latency_ms"]["p50"],
             "hit_ratio": hits / max(hits + misses, 1)}
    RunDir(run_dir).serving_path.write_text(json.dumps({
        "goodput": goodput, "slo_ms": SLO_MS, "inputs": "distinct (held-out digits + noise), cache off",
        "trials": trials, "cache_check": {**cache, "uncached_p50_ms": uncached["latency_ms"]["p50"],
                                          "note": "repeated inputs with the cache on, measured apart from goodput"}},
        indent=2))
    return {"goodput": goodput, "p99_ms": at_goodput["latency_ms"]["p99"], "p50_ms": at_goodput["latency_ms"]["p50"],
            "failed_at": failed, "plot": str(plot), "cache": cache,
            "p50_at_cache_rate_ms": uncached["latency_ms"]["p50"]}


def _metric_sum(server: Any, name: str) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


if __name__ == "__main__":
    sys.exit(main())
