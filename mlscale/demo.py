"""``make demo``: the main job end to end on the embedded defaults.

Today: train the digits MLP on 2 local data-parallel workers (progress bar), evaluate and plot; register
the model in the local registry, promote it to Production, export it to ONNX (checked against
PyTorch); print one summary table. Serving joins the same table when it lands.
"""

from __future__ import annotations

import shutil
import sys
import time

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
    rows = [
        ("eval accuracy", f"{report['eval']['accuracy']:.2%} on {RUN_DIR}'s held-out digits"),
        ("training throughput", f"{report['samples_per_s']:,.0f} samples/s ({report['world_size']} workers)"),
        ("final training loss", f"{report['final_loss']:.4f} after {report['steps']} steps"),
        ("registered", f"{version.uri} (stage Production; `mlscale models show {MODEL_NAME}`)"),
        ("ONNX export", f"max abs error vs PyTorch {parity.max_abs_err:.1e} on {parity.samples} held-out digits"),
        ("serving goodput, p99", "not yet built (serving lands with the inference server)"),
        ("cache hit ratio", "not yet built"),
        ("plots", str(plot)),
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


if __name__ == "__main__":
    sys.exit(main())
