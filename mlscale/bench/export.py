"""``mlscale bench export``: inference latency of onnxruntime vs eager PyTorch on the digits models.

Each model is trained briefly, registered in a scratch registry and exported to ONNX through the same
path users take. Then, at each batch size, the two runtimes are called alternately in rounds on the
same inputs (1 thread each, so neither gets more of the machine), and the median and p90 latency per
call are reported with the ratio torch / onnxruntime.
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
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, int_at_least, int_list
from mlscale.export.session import onnx_session

MODELS = {"digits-mlp": "digits", "digits-cnn": "digits-cnn"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "export")
    p.add_argument("--batch-sizes", type=int_list(1), default=[1, 8, 32, 128],
                   help="comma-separated (default 1,8,32,128)")
    p.add_argument("--rounds", type=int_at_least(1), default=5, help="alternating rounds per batch size (default 5)")
    p.add_argument("--calls", type=int_at_least(1), default=200, help="calls per runtime per round (default 200)")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_calls(call: Any, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _prepare(scratch: Path) -> dict[str, tuple[Any, Any, Any]]:
    from mlscale import TrainConfig, fit
    from mlscale.export import export_version
    from mlscale.registry import Registry, load_torch_model, register_run
    from mlscale.registry.models import task_of

    registry = Registry(str(scratch / "registry"))
    prepared = {}
    for label, task in MODELS.items():
        fit(TrainConfig(task=task, steps=50, run_dir=str(scratch / label)))
        version = register_run(registry, scratch / label, label)
        export_version(registry, version.uri)
        version = registry.resolve(version.uri)
        session = onnx_session(registry.artifact_bytes(version, "model.onnx"), threads=1)
        prepared[label] = (load_torch_model(registry, version), session, task_of(version.config).eval.inputs)
    return prepared


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    results: dict[str, Any] = {"models": {}}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-export-") as tmp:
        prepared = _prepare(Path(tmp))
        torch.set_num_threads(1)
        try:
            for label, (model, session, inputs) in prepared.items():
                rows = {}
                for batch in args.batch_sizes:
                    x = inputs[:batch].contiguous()
                    x_np = x.numpy()

                    def torch_call(model=model, x=x) -> None:
                        with torch.inference_mode():
                            model(x)

                    def ort_call(session=session, x_np=x_np) -> None:
                        session.run(["output"], {"input": x_np})

                    timings: dict[str, list[float]] = {"torch": [], "onnxruntime": []}
                    for call in (torch_call, ort_call):
                        _time_calls(call, 20)  # warm-up
                    for round_ in range(args.rounds):
                        order = [("torch", torch_call), ("onnxruntime", ort_call)]
                        for name, call in order if round_ % 2 == 0 else order[::-1]:
                            timings[name] += _time_calls(call, args.calls)
                    rows[str(batch)] = {
                        name: {"p50_ms": statistics.median(t), "p90_ms": _percentile(t, 0.9)}
                        for name, t in timings.items()
                    }
                    rows[str(batch)]["speedup_onnxruntime"] = (rows[str(batch)]["torch"]["p50_ms"]
                                                               / rows[str(batch)]["onnxruntime"]["p50_ms"])
                    print(f"{label} batch {batch:>4}: torch {rows[str(batch)]['torch']['p50_ms']:.3f} ms, "
                          f"onnxruntime {rows[str(batch)]['onnxruntime']['p50_ms']:.3f} ms",
                          file=sys.stderr, flush=True)
                results["models"][label] = rows
        finally:
            torch.set_num_threads(threads)
    results.update({
        "benchmark": "inference latency: onnxruntime vs eager PyTorch (torch.inference_mode)",
        "how": f"1 thread each, alternating rounds ({args.rounds} x {args.calls} calls per runtime and batch size), "
               "median and p90 of per-call wall time; models trained 50 steps, exported via mlscale export",
        "command": "mlscale bench export " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "export"] else "",
        "machine": machine_info(),
    })
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results["models"]), figsize=(6 * len(results["models"]), 4))
    for ax, (label, rows) in zip(axes, results["models"].items()):
        batches = [int(b) for b in rows]
        for runtime, color in (("torch", "tab:gray"), ("onnxruntime", "tab:blue")):
            ax.plot(batches, [rows[str(b)][runtime]["p50_ms"] for b in batches], marker="o", color=color,
                    label=f"{runtime} p50")
            ax.plot(batches, [rows[str(b)][runtime]["p90_ms"] for b in batches], linestyle="--", color=color,
                    alpha=0.6, label=f"{runtime} p90")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="latency per call (ms)", title=label)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.legend()
    fig.suptitle("Inference latency, 1 thread: onnxruntime vs eager PyTorch")
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "export", results, plot)
    for label, rows in results["models"].items():
        for batch, row in rows.items():
            print(f"{label:<11} batch {batch:>4}  torch {row['torch']['p50_ms']:7.3f} ms  onnxruntime "
                  f"{row['onnxruntime']['p50_ms']:7.3f} ms  speed-up {row['speedup_onnxruntime']:.2f}x")
    print(f"wrote {json_path} and {png_path}")
    return results
