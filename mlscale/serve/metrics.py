"""Prometheus metrics, named after Triton's where Triton has one (``nv_`` becomes ``mlscale_``).

The values live in float64 cells (``cells.py``: a worker's are in a file the other workers read, so a
scrape of any of them counts every worker's requests up to that moment) behind plain Python objects,
and are turned into Prometheus metric families only when ``/metrics`` is scraped (a custom collector,
as high-rate exporters do). prometheus_client's own Counter and Histogram take a lock on every update
(and in its multiprocess mode a file write too); a cache hit made five such updates, about a third of
its time in the server. Every update here happens on the event loop's thread (the batcher records its
batches after awaiting them), so no lock is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mlscale.serve.cache import ResponseCache
from mlscale.serve.cells import Cells, Key
from mlscale.serve.generation.series import GenerationSeries, families
from mlscale.serve.series import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LABELS = ["model", "version"]


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


# A version's series by kind, by attribute name: what a worker's snapshot carries (``ModelStats.snapshot``)
COUNTER_FIELDS = ("success", "inferences", "executions", "compute_requests", "compute_request_seconds",
                  "feature_log_failures", "routed", "routed_success", "routed_failed", "routed_client_errors",
                  "shadow_sent", "shadow_skipped", "shadow_compared", "shadow_agreed", "shadow_abs_diff",
                  "shadow_failed")
HISTOGRAM_FIELDS = ("duration", "queue", "compute", "batch_size", "routed_duration", "shadow_latency",
                    "shadow_primary_latency")
GAUGE_FIELDS = ("queue_depth", "batch_target", "admission_limit", "loaded", "executing", "share")


ROLES = ("primary", "canary", "shadow")  # a version's role, kept in a cell as its index here


def snapshot_of(cells: dict[Key, list[float]]) -> dict[str, Any]:
    """A process's series as ``ServerMetrics.snapshot`` shapes them, from the cells of its file
    (``cells.read_cells``); what only the process knows (the skew report, the cache's and the request
    bodies' bytes) is not in it."""
    models: dict[tuple[str, str], dict[str, Any]] = {}
    refused = {}
    for key, values in cells.items():
        if key[0] == "refused":
            refused[key[1]] = values[0]
            continue
        model, version, section, name = key
        entry = models.get((model, version))
        if entry is None:
            entry = models[(model, version)] = {
                "labels": [model, version], "role": "primary", "counters": {}, "cache": {}, "failures": {},
                "client_errors": {}, "histograms": {}, "gauges": {}, "last_inference_ms": 0, "skew": [],
                "generation": {}}
        if section == "histograms":
            entry[section][name] = [[int(count) for count in values[:-1]], values[-1]]
        elif section == "generation":
            entry[section][name] = values
        elif section == "state":
            entry[name] = ROLES[int(values[0])] if name == "role" else int(values[0])
        else:
            entry[section][name] = values[0]
    return {"models": list(models.values()), "refused": refused}


class ModelStats:
    """One model version's series (``ServerMetrics.stats_for`` hands out one per version), in ``cells``
    (private ones when not given)."""

    def __init__(self, model: str, version: str, cells: Cells | None = None) -> None:
        self.labels = [model, version]
        self._cells = cells or Cells()

        def counter(section: str, name: str) -> Counter:
            return Counter(self._cells.block((model, version, section, name), 1))

        def gauge(name: str, section: str = "gauges") -> Gauge:
            return Gauge(self._cells.block((model, version, section, name), 1))

        def histogram(name: str, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(bounds, self._cells.block((model, version, "histograms", name), len(bounds) + 2))

        # how requests reach it: primary, canary (a share of them) or shadow (copies); an index of ROLES
        self._role = gauge("role", "state")
        self.holders: dict[str, int] = {}  # role -> slots serving this version in it now (hold, release)
        self.success, self.inferences, self.executions = (
            counter("counters", name) for name in ("success", "inferences", "executions"))
        self.cache = {how: counter("cache", how) for how in ("hit", "miss", "coalesced")}
        self.duration, self.queue, self.compute = (histogram(name) for name in ("duration", "queue", "compute"))
        self.batch_size = histogram("batch_size", BATCH_BUCKETS)
        self.queue_depth, self.batch_target, self.admission_limit, self.loaded, self.executing = (
            gauge(name) for name in ("queue_depth", "batch_target", "admission_limit", "loaded", "executing"))
        self.failures: dict[str, Counter] = {}  # the server's failures by reason (5xx: overloaded, model, ...)
        # the client's mistakes by reason (4xx: a body that does not parse): apart, so that a client's
        # typos never count against a version (its error rate, a canary's promotion gate)
        self.client_errors: dict[str, Counter] = {}
        # wall clock (ms) of the last model execution (the statistics extension's)
        self._last_inference_ms = gauge("last_inference_ms", "state")
        # per request, as Triton counts compute: each request of a batch, with its batch's duration
        self.compute_requests, self.compute_request_seconds = (
            counter("counters", name) for name in ("compute_requests", "compute_request_seconds"))
        self.feature_skew: Any = None  # a model served from features: its FeatureSkew
        self.skew_rows: list[dict[str, Any]] = []  # in a MetricsView: the skew report of a worker's snapshot
        self.feature_log_failures = counter("counters", "feature_log_failures")
        self.routed = counter("counters", "routed")  # requests sent to this version by name, by the traffic split
        # what became of those routed requests: what `models compare` judges a canary (and its champion) by
        self.routed_success, self.routed_failed, self.routed_client_errors = (
            counter("counters", name) for name in ("routed_success", "routed_failed", "routed_client_errors"))
        self.routed_duration = histogram("routed_duration")
        self.share = gauge("share")  # the percentage of requests by name the split asks for (canary and primary)
        # a shadow version: copies sent, skipped (its queue full), compared with the served answer, agreed
        # (same class, or equal within tolerance), the sum of mean absolute differences, failed calls
        self.shadow_sent, self.shadow_skipped, self.shadow_compared = (
            counter("counters", name) for name in ("shadow_sent", "shadow_skipped", "shadow_compared"))
        self.shadow_agreed, self.shadow_abs_diff, self.shadow_failed = (
            counter("counters", name) for name in ("shadow_agreed", "shadow_abs_diff", "shadow_failed"))
        self.shadow_latency, self.shadow_primary_latency = (
            histogram(name) for name in ("shadow_latency", "shadow_primary_latency"))
        self.generation: GenerationSeries | None = None  # a language model's: made by ``generating``

    @property
    def role(self) -> str:
        return ROLES[int(self._role.value)]

    @role.setter
    def role(self, role: str) -> None:
        self._role.set(ROLES.index(role))

    @property
    def last_inference_ms(self) -> int:
        return int(self._last_inference_ms.value)

    @last_inference_ms.setter
    def last_inference_ms(self, value: int) -> None:
        self._last_inference_ms.set(value)

    def generating(self) -> GenerationSeries:
        """The series of a version that generates text (made on first use: others have none)."""
        if self.generation is None:
            self.generation = GenerationSeries(self.labels, self._cells)
        return self.generation

    def hold(self, role: str) -> None:
        """A slot serves this version in ``role`` from now on (a version may be both a model's primary and
        its canary, after a promotion): loaded while any slot holds it; its role the primary's if one is."""
        self.holders[role] = self.holders.get(role, 0) + 1
        self._held()

    def release(self, role: str) -> None:
        self.holders[role] = max(0, self.holders.get(role, 0) - 1)
        self._held()

    def _held(self) -> None:
        self.loaded.set(1 if any(self.holders.values()) else 0)
        self.role = next((role for role in ("primary", "canary", "shadow") if self.holders.get(role)), self.role)

    def snapshot(self) -> dict[str, Any]:
        """Every series as plain JSON values: what a worker publishes for the others to merge."""
        return {"labels": self.labels, "role": self.role,
                "counters": {name: getattr(self, name).value for name in COUNTER_FIELDS},
                "cache": {how: counter.value for how, counter in self.cache.items()},
                "failures": {reason: counter.value for reason, counter in self.failures.items()},
                "client_errors": {reason: counter.value for reason, counter in self.client_errors.items()},
                "histograms": {name: [getattr(self, name).counts, getattr(self, name).sum]
                               for name in HISTOGRAM_FIELDS},
                "gauges": {name: getattr(self, name).value for name in GAUGE_FIELDS},
                "last_inference_ms": self.last_inference_ms,
                "skew": self.feature_skew.report() if self.feature_skew is not None else [],
                "generation": self.generation.snapshot() if self.generation is not None else {}}

    def absorb(self, snapshot: dict[str, Any], gauges: bool = True) -> None:
        """Add a worker's counters and histograms to these (a whole-server view); its gauges are added
        too unless ``gauges`` is False (a worker that is gone holds nothing now)."""
        for name, value in snapshot["counters"].items():
            getattr(self, name).inc(value)
        for how, value in snapshot["cache"].items():
            self.cache[how].inc(value)
        for reason, value in snapshot["failures"].items():
            self.failure(reason, value)
        for reason, value in snapshot.get("client_errors", {}).items():
            self.client_error(reason, value)
        for name, (counts, total) in snapshot["histograms"].items():
            getattr(self, name).add(counts, total)
        if gauges:
            for name, value in snapshot["gauges"].items():
                gauge = getattr(self, name)
                gauge.set(max(gauge.value, value) if name in ("loaded", "share") else gauge.value + value)
            self.role = snapshot["role"]
        self.last_inference_ms = max(self.last_inference_ms, snapshot["last_inference_ms"])
        if snapshot.get("generation"):
            self.generating().absorb(snapshot["generation"], gauges)

    def failure(self, reason: str, count: float = 1.0) -> None:
        counter = self.failures.get(reason)
        if counter is None:
            counter = self.failures[reason] = Counter(self._cells.block((*self.labels, "failures", reason), 1))
        counter.inc(count)

    def client_error(self, reason: str, count: float = 1.0) -> None:
        counter = self.client_errors.get(reason)
        if counter is None:
            block = self._cells.block((*self.labels, "client_errors", reason), 1)
            counter = self.client_errors[reason] = Counter(block)
        counter.inc(count)


class ServerMetrics:
    """One process's series. ``/metrics`` and the statistics calls read a ``MetricsView``: this
    process's series, merged, in a server of several workers, with every other worker's (``peers``, see
    ``mlscale.serve.peers``): their counters as they are now, read from their cells."""

    def __init__(self, cache: ResponseCache | None = None, peers: Any = None) -> None:
        """``peers``: the workers of a server of several (``peers.Peers``): this worker's cells are in
        its file there, and a view merges every worker's; None for a server of one process."""
        self.models: dict[tuple[str, str], ModelStats] = {}
        self.cache = cache  # read at scrape time: the bytes it really holds, never a stale copy
        self.peers = peers
        self.cells: Cells = peers.cells if peers is not None else Cells()
        # requests refused before any model was chosen: a body too slow to arrive, or past the body budget
        self.refused = {reason: Counter(self.cells.block(("refused", reason), 1))
                        for reason in ("read_timeout", "body_budget", "connections")}
        self.body_bytes: Any = None  # the server's BodyBudget: request-body bytes held now

    def stats_for(self, model: str, version: str) -> ModelStats:
        """The series of one version; a version loaded again later (an alias moved back) continues them."""
        stats = self.models.get((model, version))
        if stats is None:
            stats = self.models[(model, version)] = ModelStats(model, version, self.cells)
        return stats

    def snapshot(self) -> dict[str, Any]:
        """This process's series as plain JSON values."""
        local = self.local()
        return {"models": [stats.snapshot() for stats in self.models.values()],
                "refused": {reason: counter.value for reason, counter in self.refused.items()},
                "body_bytes": local["body_bytes"], "cache": local["cache"]}

    def local(self) -> dict[str, Any]:
        """What is not in the cells, known to this process only: the request bodies' and the response
        cache's bytes, each version's feature-skew report (what a worker publishes every ``PUBLISH_S``)."""
        cache = self.cache
        return {"body_bytes": self.body_bytes.held if self.body_bytes is not None else 0,
                "cache": None if cache is None else [cache.bytes, cache.max_bytes, len(cache)],
                "skew": [[*stats.labels, stats.feature_skew.report()] for stats in self.models.values()
                         if stats.feature_skew is not None]}

    def view(self) -> MetricsView:
        """The whole server's series: this process's, with every other worker's when there are several."""
        if self.peers is None:
            return MetricsView.merge([(None, self.snapshot(), True)])
        return MetricsView.merge(self.peers.snapshots(self.snapshot()), self.peers.extra())

    def render(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(self.view())  # type: ignore[arg-type]  # a collector is anything with collect()
        return generate_latest(registry)


class MetricsView:
    """The series of a whole server, merged from its workers' snapshots: counters and histograms summed
    (those of a worker that died included: a counter never goes back), gauges per live worker (with a
    ``worker`` label when there are several)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, str], ModelStats] = {}
        self.per_worker: list[tuple[str | None, ModelStats]] = []
        self.refused: dict[str, float] = {}
        self.body_bytes = 0.0
        self.cache: list[float] | None = None
        self.extra: list[Metric] = []

    @classmethod
    def merge(cls, snapshots: list[tuple[str | None, dict[str, Any], bool]],
              extra: list[Metric] | None = None) -> MetricsView:
        """``snapshots``: (worker label, snapshot, live); ``extra``: families of the server as a whole."""
        view = cls()
        view.extra = extra or []
        for worker, snapshot, live in snapshots:
            for model in snapshot["models"]:
                labels = tuple(model["labels"])
                total = view.models.get(labels)
                if total is None:
                    total = view.models[labels] = ModelStats(*labels)
                total.absorb(model, gauges=live)
                if live:
                    own = ModelStats(*labels)
                    own.absorb(model)
                    own.skew_rows = model["skew"]
                    view.per_worker.append((worker, own))
            for reason, value in snapshot["refused"].items():
                view.refused[reason] = view.refused.get(reason, 0.0) + value
            if live:
                view.body_bytes += snapshot["body_bytes"]
                if snapshot["cache"] is not None:
                    view.cache = [a + b for a, b in zip(view.cache or [0, 0, 0], snapshot["cache"])]
        return view

    def collect(self) -> Iterator[Metric]:
        models = list(self.models.values())
        several = any(worker is not None for worker, _ in self.per_worker)
        gauge_labels = [*LABELS, "worker"] if several else LABELS

        def per_worker(worker: str | None, stats: ModelStats) -> list[str]:
            return [*stats.labels, worker] if several else stats.labels  # type: ignore[list-item]

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
        client_errors = CounterMetricFamily("mlscale_inference_request_client_error", "Inference requests "
                                            "refused as the client's mistake (4xx: a body that does not parse, a "
                                            "wrong shape or datatype); not failures", labels=[*LABELS, "reason"])
        for stats in models:
            for reason, counter in stats.client_errors.items():
                client_errors.add_metric([*stats.labels, reason], counter.value)
        yield client_errors
        for series, name, doc in HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            for stats in models:
                histogram = series(stats)
                family.add_metric(stats.labels, histogram.buckets(), histogram.sum)
            yield family
        for series, name, doc in GAUGES:
            family = GaugeMetricFamily(name, doc, labels=gauge_labels)
            for worker, stats in self.per_worker:
                family.add_metric(per_worker(worker, stats), series(stats).value)
            yield family
        yield from _rollout_families(models)
        yield from families([stats.generation for stats in models if stats.generation is not None],
                            [(per_worker(worker, stats), stats.generation) for worker, stats in self.per_worker
                             if stats.generation is not None], gauge_labels)
        skew = GaugeMetricFamily("mlscale_feature_skew", "Distance of the served feature values from the training "
                                 "distribution (Jensen-Shannon, numeric; L-infinity, categorical)",
                                 labels=[*gauge_labels, "feature"])
        for worker, stats in self.per_worker:
            for row in stats.skew_rows:
                skew.add_metric([*per_worker(worker, stats), row["feature"]], row["distance"])
        yield skew
        refused = CounterMetricFamily("mlscale_http_request_refused", "HTTP requests refused before their body "
                                      "was read whole (read_timeout: 408; body_budget: 503) and connections "
                                      "refused past --max-connections (connections: 503)", labels=["reason"])
        for reason, value in self.refused.items():
            refused.add_metric([reason], value)
        yield refused
        yield GaugeMetricFamily("mlscale_request_body_bytes", "Request-body bytes held now (bounded by "
                                "--max-inflight-mb)", value=self.body_bytes)
        if self.cache is not None:
            held, bound, entries = self.cache
            yield GaugeMetricFamily("mlscale_cache_bytes", "Bytes held by the response cache (values, keys and "
                                    "per-entry overhead)", value=held)
            yield GaugeMetricFamily("mlscale_cache_max_bytes", "The response cache's bound (--cache-mb)",
                                    value=bound)
            yield GaugeMetricFamily("mlscale_cache_entries", "Entries in the response cache", value=entries)
        yield from self.extra


def _rollout_families(models: list[ModelStats]) -> Iterator[Metric]:
    """The traffic split and the shadow's comparison, per version (labelled with its role)."""
    labels = [*LABELS, "role"]
    routed = CounterMetricFamily("mlscale_route_count", "Requests by model name routed to this version by the "
                                 "traffic split (--canary)", labels=labels)
    share = GaugeMetricFamily("mlscale_route_share_percent", "The share of requests by model name the split "
                              "asks for this version", labels=labels)
    answers = CounterMetricFamily("mlscale_route_answer_count", "What became of the requests the traffic split "
                                  "routed to this version: success, failure (the server's, 5xx) or client_error "
                                  "(4xx); what `mlscale models compare` judges", labels=[*labels, "outcome"])
    for stats in models:
        if stats.role != "shadow":
            routed.add_metric([*stats.labels, stats.role], stats.routed.value)
            share.add_metric([*stats.labels, stats.role], stats.share.value)
            for outcome, counter in (("success", stats.routed_success), ("failure", stats.routed_failed),
                                     ("client_error", stats.routed_client_errors)):
                answers.add_metric([*stats.labels, stats.role, outcome], counter.value)
    yield routed
    yield share
    yield answers
    shadows = [stats for stats in models if stats.role == "shadow" or stats.shadow_sent.value]
    for field, name, doc in SHADOW_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        for stats in shadows:
            family.add_metric(stats.labels, getattr(stats, field).value)
        yield family
    for field, name, doc in SHADOW_HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        for stats in shadows:
            histogram = getattr(stats, field)
            family.add_metric(stats.labels, histogram.buckets(), histogram.sum)
        yield family


SHADOW_COUNTERS = [
    ("shadow_sent", "mlscale_shadow_request_count", "Requests copied to this shadow version"),
    ("shadow_skipped", "mlscale_shadow_skipped_count", "Copies dropped because the shadow's queue was full "
     "(the served path never waits for the shadow)"),
    ("shadow_failed", "mlscale_shadow_failure_count", "Copies the shadow version failed to answer"),
    ("shadow_compared", "mlscale_shadow_compared_count", "Shadow answers compared with the served answers"),
    ("shadow_agreed", "mlscale_shadow_agreed_count", "Shadow answers that agree with the served ones (same class "
     "for class scores, else equal within 1e-3 relative; a greedy generation: the same tokens)"),
    ("shadow_abs_diff", "mlscale_shadow_abs_diff_sum", "Sum over compared answers of the mean absolute difference "
     "between the shadow's and the served output"),
]
SHADOW_HISTOGRAMS = [
    ("shadow_latency", "mlscale_shadow_duration_seconds", "Shadow version's time per copied request"),
    ("shadow_primary_latency", "mlscale_shadow_served_duration_seconds", "The served version's time for the "
     "same requests (the shadow's latency is compared with it)"),
]
