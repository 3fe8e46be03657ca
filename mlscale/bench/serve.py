"""``mlscale bench serve``: goodput at an SLO, side by side with LitServe, a plain FastAPI endpoint and
the offline batched ceiling, on two models.

Each server runs in its own process pinned to CPU 0; the open-loop Poisson load generator
(``loadgen.py``) runs pinned to CPU 1. For each server the offered rate doubles until a trial fails,
then is bisected; goodput is the highest rate whose trial had p99 <= SLO, < 0.1% errors and a generator
that kept up. Every trial is a point of the latency-throughput curve. The cache-hit check compares
p50 of repeated identical requests to mlscale with a no-op JSON endpoint at the same rate; the
overload check offers 2x mlscale's goodput and reports the p99 of the admitted requests. With the
defaults (two models, four systems, three repeats) it takes about 35 minutes; ``--quick`` (digits
only, one repeat, short trials, goodput only) gives a first look in two or three.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlscale.bench.anchors import LITSERVE_SYSTEMS, litserve_config
from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option, float_above, int_at_least, name_list
from mlscale.errors import UsageError
from mlscale.export.session import onnx_session

SERVER_CPU, LOADGEN_CPU = 0, 1
# Persistent connections the load generator opens before a trial, and the most it keeps (past them a
# request waits for a free connection, its latency counted from its intended time).
# Enough that connection set-up stays out of the measurement: with 64, a burst at ~4,800 requests/s on
# the 2048-wide MLP (~80 requests in flight on average) had the generator open a few hundred new
# connections per trial, and each costs the server an accept and a protocol object; a burst of them
# fed on itself into a p99 of ~400 ms in one trial of eight. With 512 the same eight trials all kept
# p99 under 40 ms. Every system gets the same pool, as a client with a connection pool (wrk2, a load
# balancer) would give it.
POOL_CONNECTIONS = 512
MODELS = {
    "digits-mlp": {"task": "digits", "options": {}, "steps": 50},
    "mlp-2048x3": {"task": "synthetic", "options": {"samples": 1024, "features": 64, "width": 2048, "depth": 3},
                   "steps": 2},
}


# mlscale-binary: the same server, sent the binary tensor data extension (tritonclient's default) instead
# of JSON tensors, and asked for binary outputs.
SYSTEMS = ("mlscale", "mlscale-binary", *LITSERVE_SYSTEMS, "fastapi")
CHECKS = ("goodput", "overload", "cache")
# --quick: what each option becomes, unless given on the command line
QUICK = {"models": ["digits-mlp"], "repeats": 1, "duration_s": 1.5, "warmup_s": 0.5, "bisect": 2,
         "checks": ["goodput"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "serve")
    p.add_argument("--quick", action="store_true",
                   help="a first look in a few minutes: digits only, 1 repeat, 1.5 s trials, goodput only "
                   "(the defaults take about 35 minutes)")
    p.add_argument("--slo-ms", type=float_above(0), default=50.0, help="p99 latency objective (default 50)")
    p.add_argument("--models", type=name_list(tuple(MODELS)), default=list(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default all)")
    p.add_argument("--systems", type=name_list(SYSTEMS), default=list(SYSTEMS),
                   help=f"servers to compare, from {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--duration-s", type=float_above(0), default=3.0, help="measured seconds per trial (default 3)")
    p.add_argument("--warmup-s", type=float_above(-1e-9), default=1.0, help="discarded seconds per trial (default 1)")
    p.add_argument("--bisect", type=int_at_least(0), default=4,
                   help="bisection steps after the first failure (default 4)")
    p.add_argument("--start-rate", type=float_above(0), default=100.0,
                   help="first offered rate, requests/s (default 100)")
    p.add_argument("--checks", type=name_list(CHECKS), default=list(CHECKS),
                   help=f"which parts to run, from {', '.join(CHECKS)} (default all)")
    p.add_argument("--overload-rate", type=float_above(0), default=None,
                   help="offered rate of the overload check (default: 2x mlscale's measured goodput)")
    p.add_argument("--repeats", type=int_at_least(1), default=3,
                   help="goodput searches per system, taking turns; the median is reported (default 3)")
    p.add_argument("--rows-per-request", type=int_at_least(1), default=1,
                   help="rows in each request (default 1); more than 1: mlscale systems only (the anchors' "
                   "endpoints take one row)")
    p.add_argument("--max-batch-size", type=int_at_least(1), default=64)
    p.add_argument("--max-delay-ms", type=float_above(-1e-9), default=10.0,
                   help="mlscale --max-delay-ms and LitServe batch_timeout, the same for both (default 10)")


def apply_quick(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """``--quick``: the QUICK values for every option left at its default."""
    if getattr(args, "quick", False):
        for name, value in QUICK.items():
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin_server(cpus: set[int] | None = None) -> None:
    """This process (and what it starts) on ``cpus``, by default the one server core."""
    if hasattr(os, "sched_setaffinity"):
        allowed = os.sched_getaffinity(0)
        wanted = (cpus or {SERVER_CPU}) & allowed
        if wanted:
            os.sched_setaffinity(0, wanted)


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    path: str
    bodies: list[str]  # JSON text, or base64 of binary bodies (with ``headers``)
    headers: dict[str, str] | None = None  # binary tensor data: the JSON header's length
    idle_s: float = 0.0  # median latency of one request at a time on the idle server (set when ready)
    processes: int = 0  # processes of the server's process group once ready, all pinned to SERVER_CPU
    config: dict[str, Any] | None = None  # a LitServe system's settings (``anchors.litserve_config``)

    def stop(self) -> None:
        """Stop the server and every process it started (LitServe's workers outlive a plain SIGTERM
        to its parent and would keep polling, skewing every later measurement)."""
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the leader is gone; make sure its children are too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
            break
        # A signal is delivered, and a child reaped by init, after killpg returns: the next measurement
        # starts only once none of them runs any more.
        deadline = time.monotonic() + 10
        while group_processes(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def prepare_models(scratch: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Train briefly, register and export each model once; returns URIs, ONNX paths and sample rows."""
    from mlscale import TrainConfig, fit
    from mlscale.export import export_version
    from mlscale.registry import Registry, register_run
    from mlscale.registry.models import task_of

    registry_dir = str(scratch / "registry")
    registry = Registry(registry_dir)
    prepared = {}
    for name in names:
        spec = MODELS[name]
        fit(TrainConfig(task=spec["task"], task_options=spec["options"], steps=spec["steps"],
                        run_dir=str(scratch / f"run-{name}")))
        version = register_run(registry, scratch / f"run-{name}", name)
        export_version(registry, version.uri)
        version = registry.resolve(version.uri)
        rows = task_of(version.config).eval.inputs[:200].numpy()
        prepared[name] = {"uri": version.uri, "registry": registry_dir, "rows": rows,
                          "onnx": str(registry.artifact_path(version, "model.onnx"))}
    return prepared


def v2_body(row: np.ndarray) -> str:
    """A JSON request of one row, or of the rows of a 2-D array."""
    rows = row.reshape(-1, row.shape[-1])
    return json.dumps({"inputs": [{"name": "input", "shape": list(rows.shape), "datatype": "FP32",
                                   "data": [float(x) for x in rows.reshape(-1)]}]})


def v2_binary_header(rows: int, width: int) -> bytes:
    """The JSON header of a binary request (the same for every request of a shape)."""
    return json.dumps({"inputs": [{"name": "input", "shape": [rows, width], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4 * rows * width}}],
                       "parameters": {"binary_data_output": True}}).encode()


def v2_binary_body(rows: np.ndarray) -> str:
    """Base64 of the JSON header and the rows' float32 bytes, as tritonclient sends them."""
    return base64.b64encode(v2_binary_header(*rows.shape) + rows.astype("<f4").tobytes()).decode()


def request_rows(rows: np.ndarray, per_request: int) -> list[np.ndarray]:
    """The sample rows grouped ``per_request`` to a request (as many requests as rows, cycling)."""
    return [np.take(rows, range(i * per_request, (i + 1) * per_request), axis=0, mode="wrap")
            for i in range(len(rows))]


def start_server(kind: str, model: dict[str, Any], args: argparse.Namespace, *, cache_mb: float = 0.0,
                 slo_ms: float | None = None, cpus: set[int] | None = None, extra: tuple[str, ...] = (),
                 litserve: dict[str, Any] | None = None) -> Server:
    """A server of ``kind`` on its own core (or on ``cpus``), ready and warmed up. ``extra``: more
    ``mlscale serve`` flags; ``litserve``: settings over ``litserve_config``'s (several workers, say)."""
    port, rows, config, headers = _free_port(), model["rows"], None, None
    if kind in ("mlscale", "mlscale-binary"):
        command = [sys.executable, "-m", "mlscale", "serve", model["uri"], "--registry", model["registry"],
                   "--port", str(port), "--max-batch-size", str(args.max_batch_size), "--max-delay-ms",
                   str(args.max_delay_ms), "--cache-mb", str(cache_mb), "--queue-limit", "4096", "--threads", "1",
                   "--no-grpc"]
        if slo_ms:
            command += ["--slo-ms", str(slo_ms)]
        command += list(extra)
        name = model["uri"].split("/")[1]
        requests = request_rows(rows, args.rows_per_request)
        encode = v2_binary_body if kind == "mlscale-binary" else v2_body
        path, bodies = f"/v2/models/{name}/infer", [encode(r) for r in requests]
        if kind == "mlscale-binary":
            headers = {"Inference-Header-Content-Length": str(len(v2_binary_header(*requests[0].shape)))}
    elif kind in (*LITSERVE_SYSTEMS, "fastapi"):
        command = [sys.executable, "-m", "mlscale.bench.anchors", kind, model["onnx"], str(port)]
        if kind in LITSERVE_SYSTEMS:
            config = {**litserve_config(kind, args.max_batch_size, args.max_delay_ms / 1e3), **(litserve or {})}
            command.append(json.dumps(config))
        path, bodies = "/predict", [json.dumps({"input": [float(x) for x in r]}) for r in rows]
    else:
        command = [sys.executable, "-m", "mlscale.bench.anchors", "noop", "-", str(port)]
        path, bodies = "/noop", [v2_body(r) for r in rows]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               preexec_fn=lambda: _pin_server(cpus), start_new_session=True)
    server = Server(kind, process, port, path, bodies, headers=headers, config=config)
    try:
        _wait_ready(server)
    except BaseException:  # a server that never came up must not stay behind, pinned to the server core
        server.stop()
        raise
    server.processes = len(group_processes(process.pid))
    return server


def group_processes(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid``: a server and every process it started (LitServe
    runs several), all sharing the one core they inherited from ``_pin_server``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def _post(conn: Any, server: Server, body: str) -> int:
    if server.headers:  # a binary body, as base64
        conn.request("POST", server.path, body=base64.b64decode(body), headers=server.headers)
    else:
        conn.request("POST", server.path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


def _wait_ready(server: Server, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} server exited with {server.process.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            if _post(conn, server, server.bodies[0]) == 200:
                times = []
                for body in itertools.islice(itertools.cycle(server.bodies), 50):  # warm up; the last 20 time it
                    start = time.perf_counter()
                    _post(conn, server, body)
                    times.append(time.perf_counter() - start)
                server.idle_s = float(np.median(times[-20:]))
                conn.close()
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} server did not answer within {timeout} s")


def wait_drained(server: Server, timeout: float = 120.0, in_a_row: int = 3) -> float:
    """Wait until the server has worked off what an earlier trial left queued; returns the seconds waited.

    A trial past capacity ends with a backlog (seconds of requests in the server's queue and the kernel's
    socket buffers), which every server keeps computing after the load generator hangs up. A trial that
    starts on top of it measures the backlog, not its own rate: a failed trial at 2x goodput then failed
    the next, lower one too (the 2048-wide MLP: p99 642 ms at 4,600 requests/s right after a 5,000 trial,
    27 ms when started idle). Drained = ``in_a_row`` single requests in a row answered 200 within twice
    the idle latency plus 2 ms. Every server here queues first in, first out, so a probe waits behind
    any backlog (the goodput and overload servers run without a response cache, which would answer a
    repeated probe ahead of the queue; the cache check starts a fresh server for every trial). Raises
    ``RuntimeError`` if the server exits or is not drained within ``timeout``: a trial then would not
    measure what it claims."""
    limit, start, good = 2 * server.idle_s + 0.002, time.perf_counter(), 0
    deadline = start + timeout
    conn = None
    try:
        while good < in_a_row:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RuntimeError(f"{server.name} server still busy {timeout:g} s after the previous trial")
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} server exited with {server.process.returncode}")
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=left)
            sent = time.perf_counter()
            try:
                status = _post(conn, server, server.bodies[0])
            except (OSError, http.client.HTTPException):
                conn.close()
                conn, status = None, 0
            good = good + 1 if status == 200 and time.perf_counter() - sent <= limit else 0
            if not good:
                time.sleep(0.05)
    finally:
        if conn is not None:
            conn.close()
    return time.perf_counter() - start


def trial(server: Server, rate: float, args: argparse.Namespace, bodies: list[str] | None = None) -> dict[str, Any]:
    """One open-loop run at ``rate``, started on a drained server."""
    drained_s = wait_drained(server)
    payload = {"bodies_b64": server.bodies, "headers": server.headers} if server.headers and bodies is None \
        else {"bodies": bodies or server.bodies}
    config = {"host": "127.0.0.1", "port": server.port, "path": server.path, **payload, "rate": rate,
              "duration_s": args.duration_s, "warmup_s": args.warmup_s,
              "cpu": getattr(args, "loadgen_cpus", None) or LOADGEN_CPU,
              "connections": POOL_CONNECTIONS, "max_connections": POOL_CONNECTIONS, "seed": int(rate)}
    output = subprocess.run([sys.executable, "-m", "mlscale.bench.loadgen"], input=json.dumps(config),
                            capture_output=True, text=True, timeout=args.duration_s + args.warmup_s + 60)
    if output.returncode != 0:
        raise RuntimeError(f"load generator failed: {output.stderr[-500:]}")
    result = json.loads(output.stdout)
    result["waited_for_drain_s"] = round(drained_s, 3)
    slo = args.slo_ms
    result["generator_ok"] = result["generator_lag_ms"]["p99"] <= 0.1 * slo
    result["meets_slo"] = (result["latency_ms"]["p99"] <= slo and result["error_rate"] < 0.001
                           and result["generator_ok"])
    return result


def find_goodput(server: Server, args: argparse.Namespace, log: Any) -> tuple[float, list[dict[str, Any]]]:
    trials, rate, good, bad = [], args.start_rate, 0.0, None
    while bad is None and rate <= 50_000:
        result = trial(server, rate, args)
        trials.append(result)
        log(server.name, result)
        if result["meets_slo"]:
            good, rate = rate, rate * 2
        else:
            bad = rate
    for _ in range(args.bisect if bad is not None else 0):
        mid = (good + bad) / 2
        result = trial(server, mid, args)
        trials.append(result)
        log(server.name, result)
        if result["meets_slo"]:
            good = mid
        else:
            bad = mid
    return good, sorted(trials, key=lambda r: r["offered_rate"])


def offline_ceiling(onnx_path: str, rows: np.ndarray, batch: int, seconds: float = 2.0) -> float:
    """Items/s of onnxruntime alone on one thread and one core, fixed batches, no HTTP: the upper bound."""
    previous = os.sched_getaffinity(0)
    _pin_server()
    try:
        session = onnx_session(onnx_path, threads=1)
        x = np.resize(rows, (batch, rows.shape[1])).astype(np.float32)
        for _ in range(10):
            session.run(["output"], {"input": x})
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            session.run(["output"], {"input": x})
            done += batch
        return done / (time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, previous)


def _log(name: str, result: dict[str, Any]) -> None:
    print(f"  {name:<14} offered {result['offered_rate']:8,.0f}/s  ok {result['throughput']:8,.0f}/s  "
          f"p50 {result['latency_ms']['p50']:7.2f} ms  p99 {result['latency_ms']['p99']:8.2f} ms  "
          f"errors {result['error_rate']:.2%}  lag p99 {result['generator_lag_ms']['p99']:.2f} ms  "
          f"{'ok' if result['meets_slo'] else 'MISS'}", file=sys.stderr, flush=True)


def measure_goodputs(model: dict[str, Any], systems: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Goodput of each system and the offline ceiling, ``--repeats`` times side by side (the systems
    take turns within each repeat); medians are the results, every repeat is kept."""
    offline: list[float] = []
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    servers: dict[str, Server] = {}
    for repeat in range(args.repeats):
        offline.append(offline_ceiling(model["onnx"], model["rows"], args.max_batch_size))
        for system in systems:
            if args.repeats > 1:
                print(f" repeat {repeat + 1}/{args.repeats}, {system}", file=sys.stderr, flush=True)
            server = start_server(system, model, args)
            try:
                goodput, trials = find_goodput(server, args, _log)
            finally:
                server.stop()
            runs[system].append({"goodput": goodput, "trials": trials, "server_processes": server.processes})
            servers[system] = server
    row: dict[str, Any] = {"systems": {}, "offline_items_per_s": float(np.median(offline)),
                           "offline_per_repeat": offline}
    for system, repeats in runs.items():
        goodputs = [r["goodput"] for r in repeats]
        median = float(np.median(goodputs))
        closest = min(repeats, key=lambda r: abs(r["goodput"] - median))  # its trials draw the curve
        row["systems"][system] = {"goodput": median, "goodput_per_repeat": goodputs, "trials": closest["trials"],
                                  "repeats": repeats, **describe_server(servers[system])}
    return row


def describe_server(server: Server) -> dict[str, Any]:
    """Where a system ran: how many processes shared the one server core and, for LitServe, its settings.

    LitServe splits a server into processes (see ``anchors``); pinned to one core they take turns on it,
    and every request crosses between them, so the count is part of what its goodput means."""
    out: dict[str, Any] = {"server_processes": server.processes, "server_cpus": [SERVER_CPU]}
    if server.config is not None:
        config = server.config
        out["litserve_config"] = config
        out["note"] = (f"{server.processes} processes, all pinned to CPU {SERVER_CPU}: the launcher, a multiprocessing "
                       f"Manager holding the queues, its resource tracker, {config['num_api_servers']} uvicorn API "
                       f"server(s), {config['workers_per_device']} inference worker(s)")
    return out


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    names, systems = list(args.models), list(args.systems)
    results: dict[str, Any] = {"models": {}}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-serve-") as tmp:
        prepared = prepare_models(Path(tmp), names)
        for name in names:
            model = prepared[name]
            print(f"{name}:", file=sys.stderr, flush=True)
            checks = list(args.checks)
            row = measure_goodputs(model, systems if "goodput" in checks else [], args)
            if "overload" in checks:
                rate = args.overload_rate or 2 * row["systems"]["mlscale"]["goodput"]
                row["overload"] = overload_check(model, args, rate)
            if "cache" in checks:
                row["cache"] = cache_check(model, args)
            _ratios(row)
            results["models"][name] = row
    results.update({
        "benchmark": ("serving goodput at an SLO: mlscale vs LitServe (batching on; as its docs recommend and tuned "
                      "for one core) vs plain FastAPI vs offline"),
        "how": (f"open-loop Poisson load (mlscale/bench/loadgen.py: bare asyncio protocols on uvloop, keeps up with "
                f"~18,000 requests/s on one core; a pool of {POOL_CONNECTIONS} persistent connections opened first, a "
                f"request finding all busy waits for one), latency from the intended send time, each trial "
                f"started on a drained server, "
                f"{args.warmup_s:g} s warm-up discarded "
                f"+ {args.duration_s:g} s measured per trial; goodput (median of {args.repeats} searches per system, "
                f"systems taking turns) = highest offered rate with p99 <= "
                f"{args.slo_ms:g} ms, < 0.1% errors and generator lag p99 <= 10% of the SLO (doubling, then "
                f"{args.bisect} bisections); server pinned to CPU {SERVER_CPU}, load generator to CPU {LOADGEN_CPU};"
                f" onnxruntime 1 thread everywhere; mlscale --max-batch-size {args.max_batch_size} --max-delay-ms "
                f"{args.max_delay_ms:g} --cache-mb 0; LitServe max_batch_size {args.max_batch_size}, batch_timeout "
                f"{args.max_delay_ms / 1e3:g} s, 1 API server, 1 inference worker, its processes all on CPU "
                f"{SERVER_CPU} (litserve-tuned: the same with the GC heap frozen after start-up, as mlscale does; "
                f"settings and process count in each system's litserve_config and server_processes); inputs: 200 "
                f"distinct held-out rows, {args.rows_per_request} per request; overload: "
                f"2x mlscale's goodput, with --slo-ms {args.slo_ms:g} and without (invalid where the generator "
                f"lagged); cache: one repeated request at 1,000/s against a bare-ASGI no-op endpoint on uvicorn, "
                f"alternating, median p50 of 5"),
        "slo_ms": args.slo_ms,
        "rows_per_request": args.rows_per_request,
        "command": "mlscale bench serve " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "serve"] else "",
        "machine": machine_info(),
    })
    return results


def _ratios(row: dict[str, Any]) -> None:
    systems = row["systems"]
    if "mlscale" not in systems:
        return
    ours = systems["mlscale"]["goodput"]
    row["ratios"] = {f"mlscale_over_{name}": ours / s["goodput"] if s["goodput"] else None
                     for name, s in systems.items() if name != "mlscale"}
    row["ratios"]["mlscale_over_offline"] = ours / (row["offline_items_per_s"] / row.get("rows_per_request", 1))


def overload_check(model: dict[str, Any], args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """An offered rate past capacity (2x goodput), with and without --slo-ms: p99 of admitted, share refused."""
    out = {}
    for label, slo in (("with_slo", args.slo_ms), ("without_slo", None)):
        server = start_server("mlscale", model, args, slo_ms=slo)
        try:
            result = trial(server, rate, args)
        finally:
            server.stop()
        _log(f"2x {label}", result)
        out[label] = {"offered_rate": result["offered_rate"], "admitted_p99_ms": result["latency_ms"]["p99"],
                      "admitted_p50_ms": result["latency_ms"]["p50"], "refused_share": result["error_rate"],
                      "admitted_per_s": result["throughput"], "statuses": result["statuses"],
                      "generator_ok": result["generator_ok"]}
    return out


def cache_check(model: dict[str, Any], args: argparse.Namespace, rate: float = 1000.0,
                repeats: int = 5) -> dict[str, Any]:
    """p50 of cache hits (one repeated request) against a no-op JSON endpoint, same rate, same body;
    the two alternate ``repeats`` times and the medians are compared."""
    body = [v2_body(model["rows"][0])]
    p50s: dict[str, list[float]] = {"mlscale": [], "noop": []}
    p99s: dict[str, list[float]] = {"mlscale": [], "noop": []}
    for _ in range(repeats):
        for kind in ("mlscale", "noop"):
            server = start_server(kind, model, args, cache_mb=64.0)
            try:
                result = trial(server, rate, args, bodies=body)
            finally:
                server.stop()
            _log(f"{kind} hit", result)
            p50s[kind].append(result["latency_ms"]["p50"])
            p99s[kind].append(result["latency_ms"]["p99"])
    out: dict[str, Any] = {kind: {"p50_ms": float(np.median(p50s[kind])), "p99_ms": float(np.median(p99s[kind])),
                                  "p50_ms_per_repeat": p50s[kind]} for kind in p50s}
    out["rate"] = rate
    out["hit_p50_over_noop_p50"] = out["mlscale"]["p50_ms"] / out["noop"]["p50_ms"]
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    colors = {"mlscale": "tab:blue", "mlscale-binary": "tab:cyan", "litserve": "tab:orange",
              "litserve-tuned": "tab:red", "fastapi": "tab:gray"}
    for ax, (name, row) in zip(axes[0], models.items()):
        for system, data in row["systems"].items():
            trials = data["trials"]
            ax.plot([t["offered_rate"] for t in trials], [t["latency_ms"]["p99"] for t in trials], marker="o",
                    color=colors.get(system), label=f"{system} (goodput {data['goodput']:,.0f}/s)")
        ax.axhline(results["slo_ms"], color="red", linestyle="--", label=f"SLO p99 {results['slo_ms']:g} ms")
        if row.get("offline_items_per_s"):  # rows/s offline, as requests/s of this many rows
            per_request = results.get("rows_per_request", 1)
            ax.axvline(row["offline_items_per_s"] / per_request, color="green", linestyle=":",
                       label=f"offline ceiling {row['offline_items_per_s'] / per_request:,.0f} requests/s "
                       f"of {per_request} row(s)")
        ax.set(xscale="log", yscale="log", xlabel="offered load (requests/s, Poisson)", ylabel="p99 latency (ms)",
               title=name)
        ax.legend(fontsize=8)
    title = "Latency vs offered load (open loop); goodput = highest load with p99 under the SLO"
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(8 * fig.get_figwidth()))))  # never cut at the edges
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    apply_quick(args, defaults.parse_args([]))
    if "overload" in args.checks and args.overload_rate is None and not {"goodput", "mlscale"} <= {
            *args.checks, *args.systems}:
        raise UsageError("bad value checks=overload: its rate is 2x mlscale's goodput, so it needs the goodput "
                         "check and the mlscale system, or an explicit --overload-rate")
    if args.rows_per_request > 1 and not set(args.systems) <= {"mlscale", "mlscale-binary"}:
        raise UsageError(f"bad value rows-per-request={args.rows_per_request}: the anchors' endpoints take one "
                         "row per request; use --systems mlscale,mlscale-binary")
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "serve", results, plot)
    for name, row in results["models"].items():
        runs = {s: ", ".join(f"{g:,.0f}" for g in d["goodput_per_repeat"]) for s, d in row["systems"].items()}
        goodputs = ", ".join(f"{s} {d['goodput']:,.0f}/s (runs: {runs[s]})" for s, d in row["systems"].items())
        ratios = {k: round(v, 3) for k, v in row.get("ratios", {}).items() if v}
        print(f"{name}: goodput at p99 <= {results['slo_ms']:g} ms: {goodputs}; offline "
              f"{row['offline_items_per_s']:,.0f} items/s; ratios {json.dumps(ratios)}")
    print(f"wrote {json_path} and {png_path}")
    return results
