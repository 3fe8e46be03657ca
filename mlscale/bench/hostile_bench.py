"""`mlscale bench hostile`: both halves side by side for each checkout, on fresh processes: the clients'
attacks on ``mlscale serve`` (``hostile.py``) and the readers' attacks on ``mlscale ui`` and the serving
supervisor (``hostile_readers.py``); JSON + PNG."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np

from mlscale.bench.hostile import ATTACKS, Target, measure
from mlscale.bench.hostile_readers import READER_ATTACKS, UI_ATTACKS, supervisor_signals, ui_trial
from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.cli.parsers import add_out_option
from mlscale.features import load_service
from mlscale.features.online import SQLiteStore, materialize

# the server flags of each attack's trial (slow bodies: with an SLO, as the finding had it)
TRIAL_FLAGS = {"slow_bodies": ["--slo-ms", "50"]}
STORE_ATTACKS = ("locked_feature_log", "silent_redis")  # served beside a model trained from features
STORE_REPOSITORY = """\"\"\"The feature repository of `mlscale bench hostile`: users' activity.\"\"\"
from datetime import timedelta

from mlscale.features import Entity, FeatureRepository, FeatureService, FeatureView, Field, FileSource
from mlscale.features import declare_repository

user = Entity("user", join_keys=["user_id"])
activity = FeatureView("activity", [user], [Field("spend"), Field("visits")], FileSource({source!r}),
                       ttl=timedelta(days=2))
model = FeatureService("model", [activity])
declare_repository(FeatureRepository([user], [activity], [model]))
"""


@dataclass
class Scratch:
    """What the trials share: the registry (digits, and churn trained from features), the online store."""

    root: Path
    registry: str
    online_store: str = ""

    def flags(self, attack: str, silent_port: int | None) -> list[str]:
        flags = list(TRIAL_FLAGS.get(attack, []))
        if attack == "locked_feature_log":
            flags += ["models:/churn/1", "--online-store", self.online_store, "--feature-log",
                      str(self.root / f"served-{time.monotonic_ns()}.db"), "--runtime", "torch", "--cache-mb", "0"]
        elif attack == "silent_redis":
            flags += ["models:/churn/1", "--online-store", f"redis://127.0.0.1:{silent_port}/0", "--runtime", "torch",
                      "--cache-mb", "0"]
        return flags


def _store_model(scratch: Scratch) -> None:
    """churn: an MLP trained on a feature service's point-in-time training set, its online store
    materialized (the module declaring the service is written into the scratch folder)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlscale import TrainConfig, fit
    from mlscale.registry import Registry, register_run

    now = datetime.now(timezone.utc).replace(tzinfo=None)
    rng = np.random.default_rng(0)
    source = scratch.root / "activity.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"user_id": u, "event_timestamp": now - timedelta(minutes=int(m)), "spend": float(s), "visits": float(v)}
        for u in range(50) for m, s, v in zip(rng.integers(10, 1400, 2), rng.gamma(2, 10, 2), rng.integers(0, 5, 2))]),
        source)
    pq.write_table(pa.Table.from_pylist([{"user_id": int(u), "event_timestamp": now - timedelta(minutes=int(m)),
                                          "label": int(u % 2)}
                                         for u, m in zip(rng.integers(0, 50, 200), rng.integers(0, 600, 200))]),
                   scratch.root / "entities.parquet")
    (scratch.root / "mlscale_bench_store.py").write_text(STORE_REPOSITORY.format(source=str(source)))
    sys.path.insert(0, str(scratch.root))
    options = {"service": "mlscale_bench_store:model", "entities": str(scratch.root / "entities.parquet")}
    fit(TrainConfig(task="features", task_options=options, steps=5, run_dir=str(scratch.root / "churn")))
    register_run(Registry(scratch.registry), scratch.root / "churn", "churn")
    repository, _ = load_service("mlscale_bench_store:model")
    scratch.online_store = str(scratch.root / "online.db")
    materialize(repository, SQLiteStore(scratch.online_store), end_date=now)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "hostile")
    p.add_argument("--seconds", type=float, default=12.0, help="how long each attack runs (default 12: past the "
                   "server's default header and body deadlines, 5 and 10 s)")
    names = [*ATTACKS, *READER_ATTACKS]
    p.add_argument("--attacks", default=",".join(names), help=f"comma-separated (default {','.join(names)})")
    p.add_argument("--baseline-src", metavar="DIR", help="another checkout of mlscale (e.g. a git worktree of an "
                   "older commit) whose server is attacked the same way, side by side")


def _server(src: Path, registry: str, flags: list[str], path: str = "") -> tuple[subprocess.Popen[str], Target]:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    uris = ["models:/digits/1", *(flag for flag in flags if flag.startswith("models:/"))]
    flags = [flag for flag in flags if not flag.startswith("models:/")]
    process = subprocess.Popen([sys.executable, "-m", "mlscale", "serve", *uris, "--port", str(ports[0]),
                                "--grpc-port", str(ports[1]), "--registry", registry, *flags], cwd=src,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(src), path)))},
                               stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, text=True)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                   "data": [0.25] * 64}]}).encode()
    target = Target(ports[0], body, grpc_address=f"127.0.0.1:{ports[1]}", pid=process.pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=1)
            connection.request("GET", "/v2/health/ready")
            if connection.getresponse().status == 200:
                return process, target
        except OSError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server from {src} did not become ready")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from mlscale import TrainConfig, fit
    from mlscale.export import export_version
    from mlscale.registry import Registry, register_run

    sources = {"mlscale": Path(__file__).resolve().parents[2]}
    if args.baseline_src:
        sources = {"baseline": Path(args.baseline_src).resolve(), **sources}
    attacks = [name.strip() for name in args.attacks.split(",") if name.strip()]
    results: dict[str, Any] = {"what": "a normal client's latency and the server's memory under each attack",
                               "how": __doc__, "machine": machine_info(), "seconds": args.seconds,
                               "servers": {label: str(src) for label, src in sources.items()}, "trials": {}}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-hostile-") as folder:
        scratch = Scratch(Path(folder), str(Path(folder) / "registry"))
        registry = Registry(scratch.registry)
        fit(TrainConfig(task="digits", steps=40, run_dir=str(Path(folder) / "run")))
        export_version(registry, register_run(registry, Path(folder) / "run", "digits").uri)
        if set(attacks) & set(STORE_ATTACKS):
            _store_model(scratch)
        silent = socket.socket()  # a Redis that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(128)
        for attack in attacks:
            for label, src in sources.items():  # each trial on a fresh server: no memory carried over
                if attack in READER_ATTACKS:
                    results["trials"].setdefault(attack, {})[label] = trial = _reader_trial(
                        attack, src, args.seconds, scratch, folder)
                    print(f"{attack:<17} {label:<9} {_said(trial)}", flush=True)
                    continue
                flags = scratch.flags(attack, silent.getsockname()[1])
                process, target = _server(src, scratch.registry, flags, path=folder)
                options = {"log_path": flags[flags.index("--feature-log") + 1]} if "--feature-log" in flags else {}
                try:
                    trial = measure(target, attack, args.seconds, **options)
                finally:
                    process.kill()
                    process.wait(10)
                results["trials"].setdefault(attack, {})[label] = trial
                print(f"{attack:<17} {label:<9} p99 {trial['client_p99_ms']} ms, errors {trial['client_errors']}"
                      f"/{trial['client_requests']}, RSS {trial['rss_idle_mb']} -> {trial['rss_peak_mb']} MB, "
                      f"connections held at the end {trial['held_at_end']}"
                      + (f", churn {trial['details']['feature_requests']} p99 {trial['details']['feature_p99_ms']} ms"
                         if "feature_requests" in trial["details"] else ""), flush=True)
        silent.close()
    return results


def _reader_trial(attack: str, src: Path, seconds: float, scratch: Scratch, folder: str) -> dict[str, Any]:
    if attack in UI_ATTACKS:
        return ui_trial(src, attack, seconds, scratch.root / "planted")
    return supervisor_signals(src, scratch.registry, path=folder)


def _said(trial: dict[str, Any]) -> str:
    if "left_something" in trial:
        return f"{trial['left_something']} of {trial['runs']} runs left a process or the port behind"
    return (f"p99 {trial['client_p99_ms']} ms, errors {trial['client_errors']}/{trial['client_requests']}, "
            f"RSS {trial['rss_idle_mb']} -> {trial['rss_peak_mb']} MB, threads {trial.get('threads_after')}, "
            f"{trial['details']}")


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    trials = results["trials"]
    attacks = [a for a in trials if all("client_p99_ms" in t for t in trials[a].values())]
    labels = list(results["servers"])
    if not attacks:  # the supervisor's trial alone: starts that left something behind, per checkout
        fig, ax = plt.subplots(figsize=(7, 4.2))
        signalled = trials["supervisor_signals"]
        ax.bar(labels, [signalled[label]["left_something"] for label in labels])
        ax.set_ylim(0, max(t["runs"] for t in signalled.values()))
        ax.set_title("mlscale serve --workers 2 signalled 0-0.3 s into its start (SIGKILL, SIGTERM):\n"
                     "runs that left a worker alive or the port bound 10 s later")
        save_figure(fig, path)
        return
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    width = 0.8 / len(labels)
    for ax, key, title in ((axes[0], "client_p99_ms", "normal client's p99 during the attack (ms, log)"),
                           (axes[1], "rss_peak_mb", "server's peak memory (MB)"),
                           (axes[2], "held_at_end", "attack's connections the server still held at its end")):
        for i, label in enumerate(labels):
            values = [trials[a][label].get(key) or 0 for a in attacks]
            places = [x + i * width for x in range(len(attacks))]
            ax.bar(places, values, width, label=label)
            if key == "client_p99_ms":  # requests the normal client had refused or failed: not in a p99
                for place, value, attack in zip(places, values, attacks):
                    trial = trials[attack][label]
                    said = f"{trial['client_errors']} failed" if trial["client_errors"] else \
                        "no answer" if not trial["client_requests"] else ""
                    if said:
                        ax.text(place, value or 1, said, ha="center", va="bottom", fontsize=8, rotation=90)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(attacks))], attacks, rotation=20)
        ax.set_title(title)
        ax.legend()
    axes[0].set_yscale("log")
    cores = results["machine"].get("cpu_cores", "?")
    title = f"Hostile clients and readers, {results['seconds']:g} s each, on 127.0.0.1, {cores} cores"
    if "supervisor_signals" in trials:  # no client there: how many starts a signal left something behind
        title += "\nsupervisor signalled 0-0.3 s into its start, runs that left a process or the port: " + ", ".join(
            f"{label} {t['left_something']}/{t['runs']}" for label, t in trials["supervisor_signals"].items())
    fig.suptitle(title)
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "hostile", results, plot)
    print(f"wrote {json_path} and {png_path}")
    return results
