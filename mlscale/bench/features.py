"""``mlscale bench features``: historical retrieval against pandas ``merge_asof``, and online lookups
in SQLite and Redis.

Retrieval: generated Parquet data, ``--entity-rows`` entity rows (random keys of ``--keys`` entities
at random times over 30 days) joined with 3 feature views of ``--source-rows`` rows each (one with a
7-day TTL). Ours: ``get_historical_features`` from the Parquet files to the result table. The
reference, pandas at its best for this: read the Parquet files, keep the last row of equal (key,
time), sort by time, ``merge_asof(by=key, direction="backward", tolerance=TTL)`` per view, back to
the entity rows' order. Both must give the same values (checked on every row); repeats alternate,
medians are reported. Lookups: one entity's features per call (``get_online_features``) from a
materialized SQLite file and from the machine's Redis server, ``--lookups`` calls after warm-up,
p50/p99.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from mlscale.bench.machine import machine_info
from mlscale.bench.report import pyplot, save_figure, write_results
from mlscale.bench.serve import _free_port, _pin_server
from mlscale.cli.parsers import add_out_option, int_at_least
from mlscale.features import (
    Entity,
    FeatureRepository,
    FeatureView,
    Field,
    FileSource,
    get_historical_features,
    load_service,
)
from mlscale.features.online import RedisStore, SQLiteStore, get_online_features, materialize

T0 = datetime(2026, 1, 1)
SPAN_US = 30 * 86_400 * 1_000_000
VIEWS = (("activity", timedelta(days=7)), ("profile", None), ("risk", None))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_option(p, "features")
    p.add_argument("--entity-rows", type=int_at_least(1000), default=10_000_000, help="default 10,000,000")
    p.add_argument("--keys", type=int_at_least(10), default=1_000_000, help="distinct entities (default 1,000,000)")
    p.add_argument("--source-rows", type=int_at_least(100), default=2_000_000,
                   help="rows per feature view (default 2,000,000)")
    p.add_argument("--repeats", type=int_at_least(1), default=3)
    p.add_argument("--lookups", type=int_at_least(100), default=2000, help="online lookups per store (default 2000)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the Redis server for the lookups")


def _generate(folder: Path, args: argparse.Namespace) -> tuple[Any, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    entity = Entity("entity", join_keys=["key"])
    views = []
    start = np.datetime64(T0, "us")

    def moments(count: int) -> np.ndarray:
        return start + rng.integers(0, SPAN_US, count).astype("timedelta64[us]")

    for index, (name, ttl) in enumerate(VIEWS):
        table = pa.table({"key": rng.integers(0, args.keys, args.source_rows),
                          "event_timestamp": moments(args.source_rows), f"f{index}": rng.normal(size=args.source_rows)})
        pq.write_table(table, folder / f"{name}.parquet")
        views.append(FeatureView(name, [entity], [Field(f"f{index}")], FileSource(str(folder / f"{name}.parquet")),
                                 ttl=ttl))
    entities = pa.table({"key": rng.integers(0, args.keys, args.entity_rows),
                         "event_timestamp": moments(args.entity_rows)})
    pq.write_table(entities, folder / "entities.parquet")
    return FeatureRepository([entity], views), folder / "entities.parquet"


def _ours(repository: Any, entities: Path) -> tuple[float, dict[str, np.ndarray]]:
    start = time.perf_counter()
    table = get_historical_features(repository, entities, [f"{v.name}:{v.features[0]}" for v in repository.views])
    elapsed = time.perf_counter() - start
    return elapsed, {v.features[0]: table.column(v.features[0]).to_numpy(zero_copy_only=False).astype(np.float64)
                     for v in repository.views}


def _pandas(repository: Any, entities: Path) -> tuple[float, dict[str, np.ndarray]]:
    import pandas as pd

    start = time.perf_counter()
    left = pd.read_parquet(entities)
    left["__row"] = np.arange(len(left))
    left = left.sort_values("event_timestamp", kind="stable")
    out = {}
    for view in repository.views:
        right = pd.read_parquet(view.source.path)
        right = right.drop_duplicates(["key", "event_timestamp"], keep="last").sort_values("event_timestamp",
                                                                                           kind="stable")
        joined = pd.merge_asof(left, right, on="event_timestamp", by="key", direction="backward",
                               tolerance=pd.Timedelta(view.ttl) if view.ttl else None)
        out[view.features[0]] = joined[view.features[0]].to_numpy()[np.argsort(joined["__row"].to_numpy())]
    return time.perf_counter() - start, out


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def _lookups(repository: Any, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    references = [f"{v.name}:{v.features[0]}" for v in repository.views]
    rng = np.random.default_rng(1)
    results = {}
    for name, store in (("sqlite", SQLiteStore(folder / "online.db")),
                        ("redis", RedisStore(args.redis, prefix=f"mlscale-bench-{time.time_ns()}"))):
        materialize(repository, store, end_date=T0 + timedelta(days=31))
        keys = rng.integers(0, args.keys, args.lookups + 100)
        latencies = []
        for index, key in enumerate(keys):
            start = time.perf_counter()
            get_online_features(repository, store, references, [{"key": int(key)}], at=T0 + timedelta(days=31))
            if index >= 100:  # warm-up left out
                latencies.append((time.perf_counter() - start) * 1e3)
        results[name] = {"p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
                         "lookups": len(latencies)}
        if name == "redis":
            keys_written = list(store.client.scan_iter(f"{store.prefix}:*"))
            for chunk in range(0, len(keys_written), 10_000):
                store.client.delete(*keys_written[chunk:chunk + 10_000])
        print(f"  {name}: lookup p50 {results[name]['p50_ms']:.3f} ms, p99 {results[name]['p99_ms']:.3f} ms",
              file=sys.stderr, flush=True)
    return results


REPO_MODULE = """
from datetime import timedelta
from mlscale.features import (Entity, FeatureRepository, FeatureService, FeatureView, Field, FileSource,
                              declare_repository)

entity = Entity("entity", join_keys=["key"])
views = [FeatureView(name, [entity], [Field(f"f{index}")], FileSource(f"{FOLDER}/{name}.parquet"), ttl=ttl)
         for index, (name, ttl) in enumerate([("activity", timedelta(days=7)), ("profile", None), ("risk", None)])]
declare_repository(FeatureRepository([entity], views, [FeatureService("model", views)]))
"""


def _served_latency(folder: Path, args: argparse.Namespace, requests: int = 1000) -> dict[str, Any]:
    """p50/p99 of one-row requests to one server: naming an entity (features looked up in SQLite) vs
    sending the tensor; sequential, alternating, on a model trained with --features."""
    import httpx
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlscale.config import TrainConfig
    from mlscale.registry import Registry, register_run
    from mlscale.train.launcher import fit

    (folder / "bench_feature_repo.py").write_text(f"FOLDER = {str(folder)!r}\n" + REPO_MODULE)
    sys.path.insert(0, str(folder))
    rng = np.random.default_rng(2)
    labels = pa.table({"key": rng.integers(0, args.keys, 2000), "label": rng.integers(0, 2, 2000),
                       "event_timestamp": np.full(2000, np.datetime64(T0 + timedelta(days=30), "us"))})
    pq.write_table(labels, folder / "labels.parquet")
    fit(TrainConfig(task="features", task_options={"service": "bench_feature_repo:model",
                                                   "entities": str(folder / "labels.parquet")},
                    steps=5, progress=False, run_dir=str(folder / "run")))
    registry = str(folder / "registry")
    register_run(Registry(registry), folder / "run", "featured")
    repository, _ = load_service("bench_feature_repo:model")
    materialize(repository, SQLiteStore(folder / "serve-online.db"), end_date=T0 + timedelta(days=31))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(folder), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "mlscale", "serve", "models:/featured/1", "--registry", registry,
                               "--port", str(port), "--no-grpc", "--runtime", "torch", "--cache-mb", "0",
                               "--online-store", str(folder / "serve-online.db")],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_pin_server)
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as client:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    if client.get(f"{base}/v2/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            bodies = {"features": lambda k: {"entities": [{"key": int(k)}]},
                      "tensor": lambda k: {"inputs": [[float(k % 7), 0.5, -1.0]]}}
            latencies: dict[str, list[float]] = {name: [] for name in bodies}
            for index, key in enumerate(rng.integers(0, args.keys, requests + 50)):
                for name, body in bodies.items():
                    start = time.perf_counter()
                    answer = client.post(f"{base}/predict", json=body(key))
                    if answer.status_code != 200:
                        raise RuntimeError(f"{name} request failed: {answer.text}")
                    if index >= 50:
                        latencies[name].append((time.perf_counter() - start) * 1e3)
    finally:
        server.terminate()
        server.wait(timeout=30)
        sys.path.remove(str(folder))
    return {name: {"p50_ms": float(np.percentile(v, 50)), "p99_ms": float(np.percentile(v, 99)), "requests": len(v)}
            for name, v in latencies.items()}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-features-") as tmp:
        folder = Path(tmp)
        print(f"generating {args.entity_rows:,} entity rows x 3 views of {args.source_rows:,} rows",
              file=sys.stderr, flush=True)
        repository, entities = _generate(folder, args)
        times: dict[str, list[float]] = {"mlscale": [], "pandas": []}
        same = True
        for repeat in range(args.repeats):
            order = (("mlscale", _ours), ("pandas", _pandas)) if repeat % 2 == 0 else \
                (("pandas", _pandas), ("mlscale", _ours))
            answers = {}
            for name, run in order:
                seconds, answers[name] = run(repository, entities)
                times[name].append(seconds)
                print(f"repeat {repeat + 1}/{args.repeats}  {name:<8} {seconds:.2f} s", file=sys.stderr, flush=True)
            same = same and _same(answers["mlscale"], answers["pandas"])
        lookups = _lookups(repository, folder, args)
        served = _served_latency(folder, args)
        print(f"  served p50: with features {served['features']['p50_ms']:.3f} ms, with the tensor "
              f"{served['tensor']['p50_ms']:.3f} ms", file=sys.stderr, flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "benchmark": "features: point-in-time historical retrieval (mlscale on DuckDB vs pandas merge_asof) and "
                     "online lookups (SQLite vs Redis)",
        "how": (f"{args.entity_rows:,} entity rows ({args.keys:,} entities, random times over 30 days) x 3 feature "
                f"views of {args.source_rows:,} rows (one with a 7-day TTL), from Parquet files to the result; "
                f"pandas: read_parquet, drop_duplicates(key, time, keep=last), sort, merge_asof(by=key, backward, "
                f"tolerance=TTL) per view, back to the entity order; {args.repeats} alternating repeats, medians; "
                f"the results compared on every row; lookups: one entity, 3 views, {args.lookups} calls of "
                "get_online_features after 100 warm-up calls"),
        "command": "mlscale bench features " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "features"]
        else "",
        "machine": machine_info(),
        "retrieval_s": medians, "retrieval_s_per_repeat": times,
        "speedup_over_pandas": medians["pandas"] / medians["mlscale"],
        "same_result": same,
        "entity_rows_per_s": args.entity_rows / medians["mlscale"],
        "lookups": lookups,
        "served_latency": served,
        "served_how": "one mlscale serve pinned to CPU 0 (torch runtime, cache off), httpx client on the other core, "
                      "sequential one-row /predict requests alternating: an entity key (3 views looked up in SQLite) "
                      "vs the tensor itself; 1,000 of each after 50 warm-up",
    }


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(results["retrieval_s"])
    bars = left.bar(names, [results["retrieval_s"][n] for n in names], color=["tab:blue", "tab:gray"])
    left.bar_label(bars, fmt="%.1f s")
    left.set_ylabel("historical retrieval, seconds (median)")
    left.set_title(f"{results['speedup_over_pandas']:.1f}x pandas, same result: {results['same_result']}")
    stores = list(results["lookups"])
    width = 0.35
    x = np.arange(len(stores))
    for offset, key in ((-width / 2, "p50_ms"), (width / 2, "p99_ms")):
        bars = right.bar(x + offset, [results["lookups"][s][key] for s in stores], width, label=key[:3])
        right.bar_label(bars, fmt="%.2f")
    right.set_xticks(x, stores)
    right.set_ylabel("online lookup, ms (one entity, 3 views)")
    right.legend()
    fig.suptitle("Feature retrieval and online lookups")
    save_figure(fig, path)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    results = run_benchmark(args)
    json_path, png_path = write_results(args.out, "features", results, plot)
    seconds = results["retrieval_s"]
    print(f"retrieval: mlscale {seconds['mlscale']:.2f} s, pandas {seconds['pandas']:.2f} s "
          f"({results['speedup_over_pandas']:.1f}x), same result: {results['same_result']}")
    print(f"wrote {json_path} and {png_path}")
    return results
