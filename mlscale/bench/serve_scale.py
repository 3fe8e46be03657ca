"""``mlscale bench serve-scale``: serving a whole host, and the cost of a safe rollout.

1. Goodput at p99 <= SLO (the search of ``bench serve``: open-loop Poisson load, the rate doubled
   until a trial fails, then bisected) of ``mlscale serve --workers N`` for N = 1, 2, 4, ... up to
   the server's cores, side by side on the same cores with LitServe at its best multi-core settings
   (``workers_per_device`` N, with one API server and with N, the better kept) and MLServer
   (``parallel_workers`` N, and 0, inference in its HTTP process, on one core; with adaptive batching
   and without; the best kept; a custom runtime on the same ONNX file, onnxruntime on one thread).
   MLServer runs from a virtual environment of its own (``--mlserver-python``: its dependencies stay
   out of this one); its 1.7 parallel workers need ``uvloop<0.21`` (later uvloop refuses the event-loop
   call they make): ``python -m venv .mlserver && .mlserver/bin/pip install mlserver onnxruntime
   'uvloop<0.21'``. The load generator runs on cores of its own (``--loadgen-cpus``, by default a
   quarter of the machine, at least one), the servers on the rest. Scaling efficiency: goodput(N) /
   (N x goodput(1)). On a 2-core machine only N = 1 with the generator apart is honest, and that is
   all that runs there.
2. The shadow's cost to the served path: p99 at a fixed rate (half of one worker's goodput measured
   above, or ``--shadow-rate``) with and without ``--shadow`` (a second version of the model, every
   request copied), taking turns, medians of the repeats.
3. The canary's split: 10,000 requests by name with ``--canary ...=10``, without a route key (an even
   split) and with 10,000 distinct keys (a hash of each); the share each version received.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mlscale.bench import serve as base
from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, float_above, int_at_least, name_list

SYSTEMS = ("mlscale", "litserve", "mlserver")
# MLServer's custom runtime: the ONNX file on onnxruntime, one thread, as every system here runs it
MLSERVER_RUNTIME = """
import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(self.settings.parameters.uri, options,
                                            providers=["CPUExecutionProvider"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        rows = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32)
        scores = self.session.run(["output"], {"input": rows})[0]
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("output", scores)])
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "serve-scale")
    p.add_argument("--model", choices=list(base.MODELS), default="mlp-2048x3",
                   help="the model served (default mlp-2048x3: batching and cores both matter for it)")
    p.add_argument("--workers", default=None, metavar="N,N,...",
                   help="worker counts to measure (default 1, 2, 4, ... up to the server's cores)")
    p.add_argument("--loadgen-cpus", type=int_at_least(1), default=None,
                   help="cores kept for the load generator (default a quarter of the machine, at least 1)")
    p.add_argument("--systems", type=name_list(SYSTEMS), default=list(SYSTEMS),
                   help=f"from {', '.join(SYSTEMS)} (default both)")
    p.add_argument("--slo-ms", type=float_above(0), default=50.0)
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="searches per point; medians (default 3)")
    p.add_argument("--duration-s", type=float_above(0), default=3.0)
    p.add_argument("--warmup-s", type=float_above(-1e-9), default=1.0)
    p.add_argument("--bisect", type=int_at_least(0), default=4)
    p.add_argument("--start-rate", type=float_above(0), default=100.0)
    p.add_argument("--max-batch-size", type=int_at_least(1), default=64)
    p.add_argument("--max-delay-ms", type=float_above(-1e-9), default=10.0)
    p.add_argument("--shadow-rate", type=float_above(0), default=None,
                   help="offered rate of the shadow check (default half of one worker's goodput)")
    p.add_argument("--split-requests", type=int_at_least(100), default=10_000)
    p.add_argument("--mlserver-python", default=None, metavar="PATH",
                   help="python of a virtual environment with mlserver and onnxruntime installed (default: "
                   "$MLSCALE_MLSERVER_PYTHON; without one, MLServer is left out and the results say so)")
    p.add_argument("--quick", action="store_true", help="1 repeat, 1.5 s trials, 2 bisection steps")
    # what bench serve's functions read and this benchmark does not vary
    p.set_defaults(rows_per_request=1)


def layout(loadgen_cpus: int | None) -> tuple[list[int], list[int]]:
    """(server cores, load generator cores) of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    keep = loadgen_cpus or max(1, len(cores) // 4)
    if keep >= len(cores):
        raise SystemExit(f"mlscale bench serve-scale: {len(cores)} cores: none left for the servers")
    return cores[:-keep], cores[-keep:]


def worker_counts(text: str | None, server_cores: int) -> list[int]:
    if text:
        counts = sorted({int(part) for part in text.split(",")})
        too_many = [n for n in counts if n > server_cores or n < 1]
        if too_many:
            raise SystemExit(f"mlscale bench serve-scale: --workers {too_many}: the servers have {server_cores} cores")
        return counts
    counts, n = [], 1
    while n <= server_cores:
        counts.append(n)
        n *= 2
    if counts[-1] != server_cores:
        counts.append(server_cores)
    return counts


def start_mlserver(model: dict[str, Any], args: argparse.Namespace, cpus: set[int], settings: dict[str, Any],
                   folder: Path) -> base.Server:
    """MLServer serving the ONNX file through ``MLSERVER_RUNTIME`` with ``settings``: ``parallel_workers``
    and ``batching`` (adaptive batching at mlscale's batch size and delay, or none)."""
    shutil.rmtree(folder, ignore_errors=True)
    name = model["uri"].split("/")[1]
    (folder / name).mkdir(parents=True)
    (folder / "onnx_runtime.py").write_text(MLSERVER_RUNTIME)
    port = base._free_port()
    (folder / "settings.json").write_text(json.dumps({
        "http_port": port, "grpc_port": base._free_port(), "metrics_port": base._free_port(),
        "parallel_workers": settings["parallel_workers"], "debug": False}))
    batching = {"max_batch_size": args.max_batch_size, "max_batch_time": args.max_delay_ms / 1e3} \
        if settings["batching"] else {}
    (folder / name / "model-settings.json").write_text(json.dumps({
        "name": name, "implementation": "onnx_runtime.OnnxModel", "parameters": {"uri": model["onnx"]},
        **batching}))
    python = Path(args.mlserver_python)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(folder)}
    process = subprocess.Popen([str(python.parent / "mlserver"), "start", str(folder)], cwd=folder, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=lambda: base._pin_server(cpus), start_new_session=True)
    bodies = [base.v2_body(r) for r in model["rows"]]
    server = base.Server("mlserver", process, port, f"/v2/models/{name}/infer", bodies,
                         config=settings)
    try:
        base._wait_ready(server)
    except BaseException:
        server.stop()
        raise
    server.processes = len(base.group_processes(process.pid))
    return server


def _goodput(system: str, model: dict[str, Any], args: argparse.Namespace, cpus: set[int], workers: int,
             litserve: dict[str, Any] | None = None) -> dict[str, Any]:
    """``litserve``: the anchor's settings (LitServe's or MLServer's)."""
    if system == "mlserver":
        assert litserve is not None
        server = start_mlserver(model, args, cpus, litserve, Path(args.scratch) / "mlserver")
    else:
        kind = "litserve-tuned" if system == "litserve" else "mlscale"
        extra = ("--workers", str(workers)) if system == "mlscale" else ()
        server = base.start_server(kind, model, args, cpus=cpus, extra=extra, litserve=litserve)
    try:
        goodput, trials = base.find_goodput(server, args, base._log)
    finally:
        server.stop()
    return {"goodput": goodput, "processes": server.processes, "trials": trials, "settings": litserve or {}}


def scaling(model: dict[str, Any], args: argparse.Namespace, server_cores: list[int]) -> dict[str, Any]:
    """Goodput per system and worker count; medians of the repeats, each repeat kept."""
    rows: dict[str, dict[str, Any]] = {system: {} for system in args.systems}
    for workers in worker_counts(args.workers, len(server_cores)):
        cpus = set(server_cores[:workers])
        for system in args.systems:
            runs = []
            for repeat in range(args.repeats):
                print(f" {system} x{workers} on cores {sorted(cpus)}, repeat {repeat + 1}/{args.repeats}",
                      file=sys.stderr, flush=True)
                if system == "mlscale":
                    runs.append(_goodput(system, model, args, cpus, workers))
                    continue
                if system == "mlserver":  # its best of N inference workers (and, on one core, none), with
                    # adaptive batching and without
                    choices = [{"parallel_workers": n, "batching": batching}
                               for n in [workers] + ([0] if workers == 1 else []) for batching in (True, False)]
                    runs.append(max((_goodput(system, model, args, cpus, workers, choice) for choice in choices),
                                    key=lambda run: run["goodput"]))
                    continue
                # LitServe's best of one API server and of as many as inference workers
                options = [{"workers_per_device": workers, "num_api_servers": 1}]
                if workers > 1:
                    options.append({"workers_per_device": workers, "num_api_servers": workers})
                runs.append(max((_goodput(system, model, args, cpus, workers, o) for o in options),
                                key=lambda run: run["goodput"]))
            rows[system][str(workers)] = {"goodput": statistics.median(r["goodput"] for r in runs),
                                          "goodput_per_repeat": [r["goodput"] for r in runs], "runs": runs}
    for row in rows.values():
        one = row.get("1", {}).get("goodput")
        for workers, point in row.items():
            point["efficiency"] = point["goodput"] / (int(workers) * one) if one else None
    return rows


def _p99_at(model: dict[str, Any], args: argparse.Namespace, cpus: set[int], rate: float,
            extra: tuple[str, ...]) -> float:
    server = base.start_server("mlscale", model, args, cpus=cpus, extra=extra)
    try:
        return base.trial(server, rate, args)["latency_ms"]["p99"]
    finally:
        server.stop()


def shadow_cost(model: dict[str, Any], shadow_uri: str, args: argparse.Namespace, cpus: set[int],
                rate: float) -> dict[str, Any]:
    plain, shadowed = [], []
    for _ in range(args.repeats):
        plain.append(_p99_at(model, args, cpus, rate, ()))
        shadowed.append(_p99_at(model, args, cpus, rate, ("--shadow", shadow_uri)))
    return {"rate": rate, "p99_ms_without": statistics.median(plain), "p99_ms_with_shadow": statistics.median(shadowed),
            "per_repeat": {"without": plain, "with_shadow": shadowed},
            "shadow": f"{shadow_uri}, every request copied (--shadow-queue 16: copies past it dropped, counted)"}


def canary_split(model: dict[str, Any], canary_uri: str, args: argparse.Namespace, cpus: set[int]) -> dict[str, Any]:
    server = base.start_server("mlscale", model, args, cpus=cpus, extra=("--canary", f"{canary_uri}=10"))
    name = model["uri"].split("/")[1]
    found = {}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        for keyed in (False, True):
            seen: dict[str, int] = {}
            for i in range(args.split_requests):
                headers = {"Content-Type": "application/json", **({"x-route-key": f"user-{i}"} if keyed else {})}
                conn.request("POST", f"/v2/models/{name}/infer", body=server.bodies[i % len(server.bodies)],
                             headers=headers)
                version = json.loads(conn.getresponse().read())["model_version"]
                seen[version] = seen.get(version, 0) + 1
            canary = seen.get(canary_uri.rsplit("/", 1)[1], 0)
            found["keyed" if keyed else "unkeyed"] = {"requests": args.split_requests, "versions": seen,
                                                      "canary_share_percent": 100 * canary / args.split_requests}
        conn.close()
    finally:
        server.stop()
    return {"asked_percent": 10.0, **found}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from mlscale.export import export_version
    from mlscale.registry import Registry, register_run

    server_cores, loadgen_cores = layout(args.loadgen_cpus)
    args.loadgen_cpus = loadgen_cores
    args.mlserver_python = args.mlserver_python or os.environ.get("MLSCALE_MLSERVER_PYTHON")
    left_out = []
    if "mlserver" in args.systems and not (args.mlserver_python and Path(args.mlserver_python).exists()):
        args.systems = [system for system in args.systems if system != "mlserver"]
        left_out.append("mlserver: no --mlserver-python (a virtual environment with mlserver and onnxruntime)")
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-scale-") as scratch:
        args.scratch = scratch
        model = base.prepare_models(Path(scratch), [args.model])[args.model]
        # a second version of the same model: the shadow's and the canary's
        registry = Registry(model["registry"])
        second = register_run(registry, Path(scratch) / f"run-{args.model}", args.model)
        export_version(registry, second.uri)
        results: dict[str, Any] = {
            "benchmark": "serve-scale", "machine": machine_info(), "model": args.model, "slo_ms": args.slo_ms,
            "server_cores": server_cores, "loadgen_cores": loadgen_cores,
            "method": "goodput = highest open-loop Poisson rate with p99 <= SLO, < 0.1% errors and a generator that "
                      "kept up; servers pinned to the first N server cores, the generator to its own cores",
            "note": ("2-core machine: only one worker with the generator on the other core is an honest figure"
                     if len(server_cores) == 1 else ""),
        }
        results["left_out"] = left_out
        results["scaling"] = scaling(model, args, server_cores)
        one = results["scaling"].get("mlscale", {}).get("1", {}).get("goodput") or 1000.0
        cpus = {server_cores[0]}
        results["shadow_cost"] = shadow_cost(model, second.uri, args, cpus, args.shadow_rate or one / 2)
        results["canary_split"] = canary_split(model, second.uri, args, cpus)
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    for system, row in results["scaling"].items():
        counts = sorted(int(n) for n in row)
        left.plot(counts, [row[str(n)]["goodput"] for n in counts], marker="o", label=system)
        if system == "mlscale" and "1" in row:
            left.plot(counts, [n * row["1"]["goodput"] for n in counts], linestyle=":", color="gray",
                      label="N x one mlscale worker")
    left.set(xlabel="workers (cores)", ylabel=f"goodput at p99 <= {results['slo_ms']:g} ms (requests/s)",
             title=f"{results['model']}: goodput by workers")
    left.legend(fontsize=8)
    cost = results["shadow_cost"]
    middle.bar(["without", "with --shadow"], [cost["p99_ms_without"], cost["p99_ms_with_shadow"]],
               color=["tab:gray", "tab:blue"])
    middle.set(ylabel="p99 (ms)", title=f"served p99 at {cost['rate']:,.0f} requests/s")
    split = results["canary_split"]
    names = ["unkeyed", "keyed"]
    right.bar(names, [split[n]["canary_share_percent"] for n in names], color="tab:blue")
    right.axhline(split["asked_percent"], color="gray", linestyle=":", label="asked")
    right.set(ylabel="canary share (%)", title=f"canary split over {split['unkeyed']['requests']:,} requests")
    right.legend(fontsize=8)
    if results.get("note"):
        fig.suptitle(results["note"], fontsize=9)
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.repeats, args.duration_s, args.warmup_s, args.bisect = 1, 1.5, 0.5, 2
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "serve-scale", results, plot)
    for system, row in results["scaling"].items():
        points = ", ".join(f"x{n} {p['goodput']:,.0f}/s (efficiency {p['efficiency']:.2f})" for n, p in row.items())
        print(f"{system}: {points}")
    cost, split = results["shadow_cost"], results["canary_split"]
    print(f"shadow: p99 {cost['p99_ms_without']:.2f} ms -> {cost['p99_ms_with_shadow']:.2f} ms "
          f"at {cost['rate']:,.0f}/s")
    print(f"canary asked 10%: unkeyed {split['unkeyed']['canary_share_percent']:.2f}%, keyed "
          f"{split['keyed']['canary_share_percent']:.2f}%")
    print(f"wrote {json_path} and {png_path}")
    return results
