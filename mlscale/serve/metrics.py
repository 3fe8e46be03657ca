"""Prometheus metrics, named after Triton's where Triton has one (``nv_`` becomes ``mlscale_``).

The values live in plain Python objects and are turned into Prometheus metric families only when
``/metrics`` is scraped (a custom collector, as high-rate exporters do). prometheus_client's own
Counter and Histogram take a lock on every update; a cache hit made five such updates, about a third
of its time in the server. Every update here happens on the event loop's thread (the batcher records
its batches after awaiting them), so no lock is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from mlscale.serve.cache import ResponseCache

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LABELS = ["model", "version"]


class Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Gauge:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bucket whose upper bound is >= value
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            cumulative += count
            out.append((bound, cumulative))
        return out


# (how to get the series from a ModelStats, metric name, help)
COUNTERS = [
    (lambda s: s.success, "mlscale_inference_request_success", "Successful inference requests"),
    (lambda s: s.inferences, "mlscale_inference_count", "Inferences performed (rows, not requests)"),
    (lambda s: s.executions, "mlscale_inference_exec_count", "Model executions (batches)"),
    (lambda s: s.cache["hit"], "mlscale_cache_num_hits_per_model", "Response cache hits"),
    (lambda s: s.cache["miss"], "mlscale_cache_num_misses_per_model", "Response cache misses"),
    (lambda s: s.cache["coalesced"], "mlscale_cache_num_coalesced_per_model",
     "Requests answered by an identical in-flight miss"),
    (lambda s: s.feature_log_failures, "mlscale_feature_log_failure",
     "Served feature vectors not written to the feature log (it is best-effort: inference goes on)"),
]
HISTOGRAMS = [
    (lambda s: s.duration, "mlscale_inference_request_duration_seconds", "End-to-end request time in the server"),
    (lambda s: s.queue, "mlscale_inference_queue_duration_seconds", "Time waiting in the queue"),
    (lambda s: s.compute, "mlscale_inference_compute_infer_duration_seconds", "Model execution time per batch"),
    (lambda s: s.batch_size, "mlscale_inference_batch_size", "Rows per executed batch"),
]
GAUGES = [
    (lambda s: s.queue_depth, "mlscale_inference_pending_request_count", "Requests waiting in the queue"),
    (lambda s: s.batch_target, "mlscale_batch_target", "Batch size the SLO controller aims for"),
    (lambda s: s.admission_limit, "mlscale_admission_limit",
     "Most admitted requests in flight, set to keep p99 under --slo-ms"),
    (lambda s: s.loaded, "mlscale_model_loaded", "1 for each loaded model version"),
    (lambda s: s.executing, "mlscale_inference_executing", "1 while a model call of this version runs"),
]


class ModelStats:
    """One model version's series (``ServerMetrics.stats_for`` hands out one per version)."""

    def __init__(self, model: str, version: str) -> None:
        self.labels = [model, version]
        self.success, self.inferences, self.executions = Counter(), Counter(), Counter()
        self.cache = {"hit": Counter(), "miss": Counter(), "coalesced": Counter()}
        self.duration, self.queue, self.compute = (Histogram(LATENCY_BUCKETS) for _ in range(3))
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.queue_depth, self.batch_target, self.admission_limit, self.loaded, self.executing = (
            Gauge() for _ in range(5))
        self.failures: dict[str, Counter] = {}
        self.last_inference_ms = 0  # wall clock of the last model execution (the statistics extension's)
        # per request, as Triton counts compute: each request of a batch, with its batch's duration
        self.compute_requests, self.compute_request_seconds = Counter(), Counter()
        self.feature_skew: Any = None  # a model served from features: its FeatureSkew
        self.feature_log_failures = Counter()

    def failure(self, reason: str) -> None:
        counter = self.failures.get(reason)
        if counter is None:
            counter = self.failures[reason] = Counter()
        counter.inc()


class ServerMetrics:
    def __init__(self, cache: ResponseCache | None = None) -> None:
        self.models: dict[tuple[str, str], ModelStats] = {}
        self.cache = cache  # read at scrape time: the bytes it really holds, never a stale copy
        # requests refused before any model was chosen: a body too slow to arrive, or past the body budget
        self.refused = {"read_timeout": Counter(), "body_budget": Counter(), "connections": Counter()}
        self.body_bytes: Any = None  # the server's BodyBudget: request-body bytes held now
        self.registry = CollectorRegistry()
        self.registry.register(self)  # type: ignore[arg-type]  # a collector is anything with collect()

    def stats_for(self, model: str, version: str) -> ModelStats:
        """The series of one version; a version loaded again later (an alias moved back) continues them."""
        stats = self.models.get((model, version))
        if stats is None:
            stats = self.models[(model, version)] = ModelStats(model, version)
        return stats

    def collect(self) -> Iterator[Metric]:
        models = list(self.models.values())
        for series, name, doc in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for stats in models:
                family.add_metric(stats.labels, series(stats).value)
            yield family
        failures = CounterMetricFamily("mlscale_inference_request_failure", "Failed inference requests",
                                       labels=[*LABELS, "reason"])
        for stats in models:
            for reason, counter in stats.failures.items():
                failures.add_metric([*stats.labels, reason], counter.value)
        yield failures
        for series, name, doc in HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            for stats in models:
                histogram = series(stats)
                family.add_metric(stats.labels, histogram.buckets(), histogram.sum)
            yield family
        for series, name, doc in GAUGES:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for stats in models:
                family.add_metric(stats.labels, series(stats).value)
            yield family
        skew = GaugeMetricFamily("mlscale_feature_skew", "Distance of the served feature values from the training "
                                 "distribution (Jensen-Shannon, numeric; L-infinity, categorical)",
                                 labels=[*LABELS, "feature"])
        for stats in models:
            for row in stats.feature_skew.report() if stats.feature_skew is not None else ():
                skew.add_metric([*stats.labels, row["feature"]], row["distance"])
        yield skew
        refused = CounterMetricFamily("mlscale_http_request_refused", "HTTP requests refused before their body "
                                      "was read whole (read_timeout: 408; body_budget: 503) and connections "
                                      "refused past --max-connections (connections: 503)", labels=["reason"])
        for reason, counter in self.refused.items():
            refused.add_metric([reason], counter.value)
        yield refused
        if self.body_bytes is not None:
            yield GaugeMetricFamily("mlscale_request_body_bytes", "Request-body bytes held now (bounded by "
                                    "--max-inflight-mb)", value=self.body_bytes.held)
        if self.cache is not None:
            yield GaugeMetricFamily("mlscale_cache_bytes", "Bytes held by the response cache (values, keys and "
                                    "per-entry overhead)", value=self.cache.bytes)
            yield GaugeMetricFamily("mlscale_cache_max_bytes", "The response cache's bound (--cache-mb)",
                                    value=self.cache.max_bytes)
            yield GaugeMetricFamily("mlscale_cache_entries", "Entries in the response cache", value=len(self.cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)
