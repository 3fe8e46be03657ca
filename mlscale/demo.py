"""``make demo``: the main job end to end on the embedded defaults.

Train the digits MLP on 2 local data-parallel workers (progress bar), evaluate and plot; register the
model in the local registry, promote it to Production, export it to ONNX (checked against PyTorch);
serve ``models:/digits-demo/Production`` and put open-loop load on it (the held-out digits, so repeated
inputs hit the response cache) to find the goodput at a 50 ms p99 SLO; print one summary table.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from mlscale import TrainConfig, fit
from mlscale.errors import MlscaleError
from mlscale.export import export_version
from mlscale.registry import Registry, register_run
from mlscale.train.plot import plot_run

RUN_DIR = "runs/demo"
REGISTRY = "mlscale-registry"
MODEL_NAME = "digits-demo"


def main() -> int:
    started = time.time()
    shutil.rmtree(RUN_DIR, ignore_errors=True)  # the demo's own folder: each demo starts afresh
    print("mlscale demo: training the digits MLP on 2 data-parallel workers (gloo on CPU, nccl on CUDA)",
          file=sys.stderr)
    try:
        report = fit(TrainConfig(task="digits", workers=2, epochs=20, batch_size=32, lr=0.05,
                                 checkpoint_every=100, run_dir=RUN_DIR))
    except MlscaleError as exc:
        print(f"mlscale demo: {exc}", file=sys.stderr)
        return exc.exit_code
    plot = plot_run(RUN_DIR)
    print(f"mlscale demo: registering in {REGISTRY}/, promoting to Production, exporting to ONNX", file=sys.stderr)
    registry = Registry(REGISTRY)
    version = register_run(registry, RUN_DIR, MODEL_NAME, description="make demo")
    registry.set_stage(MODEL_NAME, version.version, "Production", archive_existing=True)
    _, parity = export_version(registry, f"models:/{MODEL_NAME}/Production")
    print("mlscale demo: serving it and searching for the goodput at p99 <= 50 ms (open-loop load)", file=sys.stderr)
    serving = measure_serving(registry)
    rows = [
        ("eval accuracy", f"{report['eval']['accuracy']:.2%} on {RUN_DIR}'s held-out digits"),
        ("training throughput", f"{report['samples_per_s']:,.0f} samples/s ({report['world_size']} workers)"),
        ("final training loss", f"{report['final_loss']:.4f} after {report['steps']} steps"),
        ("registered", f"{version.uri} (stage Production; `mlscale models show {MODEL_NAME}`)"),
        ("ONNX export", f"max abs error vs PyTorch {parity.max_abs_err:.1e} on {parity.samples} held-out digits"),
        ("serving goodput", f"{serving['goodput']:,.0f} requests/s at p99 <= 50 ms (p99 there: "
                            f"{serving['p99_ms']:.1f} ms, p50 {serving['p50_ms']:.1f} ms)"),
        ("cache hit ratio", f"{serving['hit_ratio']:.1%} of {serving['requests']:,} requests answered from the cache"),
        ("plots", f"{plot}, {serving['plot']}"),
        ("run directory", f"{RUN_DIR} (report.json, metrics.jsonl, checkpoints/, final/)"),
        ("demo wall time", f"{time.time() - started:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    print("mlscale demo summary")
    print("-" * (width + 60))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def measure_serving(registry: Registry) -> dict[str, float | str]:
    """Serve the Production model in its own process and search for its goodput (short trials)."""
    import argparse
    import json

    import httpx

    from mlscale.bench import serve as bench
    from mlscale.registry.models import task_of

    version = registry.resolve(f"models:/{MODEL_NAME}/Production")
    rows = task_of(version.config).eval.inputs.numpy()
    model = {"uri": f"models:/{MODEL_NAME}/Production", "registry": REGISTRY, "rows": rows}
    args = argparse.Namespace(max_batch_size=64, max_delay_ms=2.0, slo_ms=50.0, duration_s=1.5, warmup_s=0.5,
                              bisect=2, start_rate=200.0)
    server = bench.start_server("mlscale", model, args, cache_mb=64.0)
    try:
        goodput, trials = bench.find_goodput(server, args, lambda *_: None)
        text = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    finally:
        server.stop()
    counts = {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
              for name in ("mlscale_cache_num_hits_per_model_total", "mlscale_cache_num_misses_per_model_total",
                           "mlscale_cache_num_coalesced_per_model_total")}
    answered = sum(counts.values())
    at_goodput = max((t for t in trials if t["meets_slo"]), key=lambda t: t["offered_rate"], default=trials[0])
    plot = Path(RUN_DIR) / "plots" / "serving.png"
    bench.plot({"slo_ms": args.slo_ms, "models": {MODEL_NAME: {"systems": {"mlscale": {
        "goodput": goodput, "trials": trials}}}}}, plot)
    (Path(RUN_DIR) / "serving.json").write_text(json.dumps({"goodput": goodput, "trials": trials}, indent=2))
    return {"goodput": goodput, "p99_ms": at_goodput["latency_ms"]["p99"], "p50_ms": at_goodput["latency_ms"]["p50"],
            "hit_ratio": (answered - counts["mlscale_cache_num_misses_per_model_total"]) / max(answered, 1),
            "requests": int(answered), "plot": str(plot)}


if __name__ == "__main__":
    sys.exit(main())
