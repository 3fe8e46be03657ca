"""`mlscale bench ui`: how long `mlscale ui` takes to show a long run on many ranks.

A run directory of ``--steps`` steps on ``--ranks`` ranks is written (metrics lines every ``--log-every``
steps in the trainer's own format, one rank slow for a stretch, a kill and restart), then, in Chromium
(Debian's, driven by Playwright), the run page is opened ``--repeats`` times: cold (a fresh `mlscale ui`
process, nothing read yet) and warm (the same process again). Measured from navigation start to the page
saying it has drawn every chart (``body[data-ready]``), and, apart, the series API call alone. The
records reach the page down-sampled (a few hundred points a chart); a zoomed range reads every record.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.rundir import RunDir

CHROMIUM = os.environ.get("MLSCALE_CHROMIUM", "/usr/bin/chromium")
KEYS = ("step_ms", "compute_ms", "comm_ms", "comm_exposed_ms", "data_wait_ms", "optimizer_ms")


def write_synthetic_run(path: Path, steps: int, ranks: int, log_every: int = 10, *, slow_rank: int = 1,
                        slow_from: float = 0.4, slow_to: float = 0.6, kill_at: float = 0.7, seed: int = 0) -> RunDir:
    """A finished ddp run's directory as the trainer writes it: config, plan, report, metrics.jsonl (one
    line every ``log_every`` steps, every rank's step split and straggler score), a killed rank's fault
    record and the restart's recovery event (the steps after the checkpoint written again)."""
    run = RunDir(path)
    path.mkdir(parents=True, exist_ok=True)
    run.write_config({"task": "synthetic", "strategy": "ddp", "workers": ranks, "steps": steps, "seed": seed,
                      "batch_size": 32, "records": {"log_every": log_every},
                      "recovery": {"fault_tolerance": "restart"}})
    (run.plan_path).write_bytes(orjson.dumps({"processes": ranks, "data_shards": ranks}))
    rng = np.random.default_rng(seed)
    logged = np.arange(log_every, steps + 1, log_every)
    kill_step = int(logged[int(len(logged) * kill_at)]) if len(logged) > 2 else steps
    resumed = max(log_every, kill_step - 5 * log_every)
    slow = (logged >= logged[int(len(logged) * slow_from)]) & (logged < logged[min(len(logged) - 1,
                                                                                   int(len(logged) * slow_to))])
    start = time.time() - steps * 0.05
    with run.metrics_path.open("wb") as out:
        def write(index: int) -> None:
            step = int(logged[index])
            compute = 20 + rng.normal(0, 0.5, ranks)
            if slow[index]:
                compute[slow_rank] *= 2.5
            fastest = compute.min()
            per_rank = [{"rank": r, "step_ms": 35.0, "compute_ms": round(float(compute[r]), 3), "comm_ms": 9.0,
                         "comm_exposed_ms": round(float(35 - compute[r] - 3), 3), "data_wait_ms": 1.0,
                         "optimizer_ms": 2.0, "straggler_score": round(float(compute[r] / fastest), 3)}
                        for r in range(ranks)]
            flagged = [r for r in range(ranks) if compute[r] / fastest >= 1.5]
            out.write(orjson.dumps({"step": step, "epoch": 0, "loss": 2.3 * math.exp(-step / steps * 3) + 0.1,
                                    "lr": 0.05, "samples_per_s": 32 * ranks / 0.035, "time": start + step * 0.05,
                                    "elapsed_s": step * 0.05, "per_rank": per_rank, "stragglers": flagged}) + b"\n")

        for index, step in enumerate(logged):
            write(index)
            if step == kill_step:  # the restart writes the steps after the checkpoint again
                for again in np.flatnonzero((logged > resumed) & (logged <= kill_step)):
                    write(int(again))
    run.logs.mkdir(exist_ok=True)
    run.faults_path.write_bytes(orjson.dumps({"kind": "kill", "rank": 0, "step": kill_step + 1, "time": start,
                                              "run_id": "synthetic"}) + b"\n")
    run.recovery_path.write_bytes(orjson.dumps({"attempt": 1, "failed_at_step": kill_step, "resumed_from_step": resumed,
                                                "steps_redone": kill_step - resumed, "downtime_s": 12.0}) + b"\n")
    run.write_report({"status": "completed", "task": "synthetic", "strategy": "ddp", "world_size": ranks,
                      "steps": steps, "final_loss": 0.15, "samples_per_s": 32 * ranks / 0.035, "restarts": 1,
                      "memory": [], "per_rank": [], "straggler_detection": {"threshold": 1.5}})
    return run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results/ui", help="where the JSON and PNG go (default bench/results/ui)")
    p.add_argument("--steps", type=int, default=100_000, help="steps of the run (default 100000)")
    p.add_argument("--ranks", type=int, default=64, help="ranks of the run (default 64)")
    p.add_argument("--log-every", type=int, action="append", default=None,
                   help="metrics line every K steps; repeat for several runs (default: 10, the trainer's "
                   "default, and 1)")
    p.add_argument("--repeats", type=int, default=5, help="page loads per case (default 5)")
    p.add_argument("--scratch", default=None, help="where the run directories are written (default a temp folder)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ui(runs: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """`mlscale ui` in its own process on a free loopback port; returns it once it answers."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlscale", "ui", "--runs", str(runs), "--port", str(port),
                                *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/api/info", timeout=2).read()
            return process, url
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"mlscale ui exited: {process.stderr.read().decode() if process.stderr else ''}") \
                    from None
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("mlscale ui did not answer within 60 s")


def _page_load_ms(browser: Any, url: str, split: list[dict[str, float]] | None = None) -> float:
    """From navigation start to the view saying it has drawn; ``split`` gets the page's own account of
    its view: time waiting on the API and in all (the rest is drawing)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        start = time.perf_counter()
        page.goto(url)
        page.wait_for_selector("body[data-ready]", state="attached", timeout=120_000)
        elapsed = (time.perf_counter() - start) * 1e3
        if split is not None:
            own = page.evaluate("() => ({fetch: Number(document.body.dataset.fetchMs), "
                                "view: Number(document.body.dataset.viewMs)})")
            split.append({"api_ms": own["fetch"], "draw_ms": round(own["view"] - own["fetch"], 1)})
        return elapsed
    finally:
        page.close()


def _api_ms(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    body = urllib.request.urlopen(url, timeout=60).read()
    return (time.perf_counter() - start) * 1e3, len(body)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="mlscale-bench-ui-"))
    cases = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for log_every in args.log_every or [10, 1]:
            runs = scratch / f"every{log_every}"
            shutil.rmtree(runs, ignore_errors=True)
            made = time.perf_counter()
            run = write_synthetic_run(runs / "long", args.steps, args.ranks, log_every)
            size_mb = run.metrics_path.stat().st_size / 1e6
            print(f"log every {log_every}: wrote {size_mb:,.0f} MB of records in {time.perf_counter() - made:.1f} s",
                  flush=True)
            cold, warm, api_cold, api_warm, zoom, split = [], [], [], [], [], []
            for _ in range(args.repeats):
                process, url = start_ui(runs)
                try:
                    cold.append(_page_load_ms(browser, f"{url}/#/run/long"))
                    warm.append(_page_load_ms(browser, f"{url}/#/run/long", split))
                    api_warm.append(_api_ms(f"{url}/api/series?id=long&points=600")[0])
                    middle, span = args.steps // 2, 300 * log_every  # 300 lines: every record of them
                    zoom.append(_api_ms(f"{url}/api/series?id=long&points=600&from={middle}&to={middle + span}")[0])
                finally:
                    process.terminate()
                    process.wait(10)
                process, url = start_ui(runs)
                try:
                    api_cold.append(_api_ms(f"{url}/api/series?id=long&points=600")[0])
                    payload = _api_ms(f"{url}/api/series?id=long&points=600")[1]
                finally:
                    process.terminate()
                    process.wait(10)
            case = {"log_every": log_every, "lines": len(run.read_metrics()), "records_mb": round(size_mb, 1),
                    "payload_kb": round(payload / 1e3, 1),
                    "page_cold_ms": cold, "page_warm_ms": warm, "api_cold_ms": api_cold, "api_warm_ms": api_warm,
                    "api_zoom_300_lines_ms": zoom, "page_warm_split": split,
                    "page_warm_draw_ms_p50": round(statistics.median(x["draw_ms"] for x in split), 1),
                    **{f"{k}_p50": round(statistics.median(v), 1) for k, v in
                       (("page_cold_ms", cold), ("page_warm_ms", warm), ("api_cold_ms", api_cold),
                        ("api_warm_ms", api_warm), ("api_zoom_300_lines_ms", zoom))}}
            cases.append(case)
            print(f"  page cold p50 {case['page_cold_ms_p50']:,.0f} ms, warm {case['page_warm_ms_p50']:,.0f} ms; "
                  f"series API cold {case['api_cold_ms_p50']:,.0f} ms, warm {case['api_warm_ms_p50']:,.0f} ms, "
                  f"zoomed {case['api_zoom_300_lines_ms_p50']:,.0f} ms; {case['payload_kb']:,.0f} kB to the page",
                  flush=True)
        browser.close()
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "what": "mlscale ui's run page for a long run on many ranks: navigation start to every chart drawn "
                "(Chromium headless via Playwright), cold (a fresh UI process, the page opened as soon as it "
                "answers: the records read for the first time, by the start-up read-ahead or the page) and warm "
                "(the same process again; the page's own split of it: API wait and drawing); the series API "
                "call alone, cold (a fresh process) and warm, and for a zoomed range of 300 records; medians",
        "steps": args.steps, "ranks": args.ranks, "repeats": args.repeats, "budget_ms": 2000,
        "chromium": _chromium_version(), "machine": machine_info(), "cases": cases,
    }


def _chromium_version() -> str:
    try:
        return subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown"


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels, cold, warm = [], [], []
    for case in results["cases"]:
        labels.append(f"log every {case['log_every']}\n{case['lines']:,} lines, {case['records_mb']:,.0f} MB")
        cold.append(case["page_cold_ms_p50"])
        warm.append(case["page_warm_ms_p50"])
    x = np.arange(len(labels))
    ax.bar(x - 0.2, cold, 0.4, label="cold (fresh UI process)", color="tab:gray")
    ax.bar(x + 0.2, warm, 0.4, label="warm", color="tab:blue")
    for i, (c, w) in enumerate(zip(cold, warm)):
        ax.text(i - 0.2, c, f"{c:,.0f}", ha="center", va="bottom")
        ax.text(i + 0.2, w, f"{w:,.0f}", ha="center", va="bottom")
    ax.axhline(results["budget_ms"], color="tab:red", linestyle="--", label="2 s budget")
    ax.set_xticks(x, labels)
    ax.set_ylabel("run page load, ms (median)")
    ax.set_title(f"mlscale ui: a run of {results['steps']:,} steps on {results['ranks']} ranks")
    ax.legend()
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "ui", results, plot)
    print(f"wrote {json_path} and {png_path}")
    return results
