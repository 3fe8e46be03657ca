"""Prometheus metrics, named after Triton's where Triton has one (``nv_`` becomes ``mlscale_``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series only double the output

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("model", "version")
        r = self.registry
        self.request_success = Counter("mlscale_inference_request_success", "Successful inference requests",
                                       labels, registry=r)
        self.request_failure = Counter("mlscale_inference_request_failure", "Failed inference requests",
                                       (*labels, "reason"), registry=r)
        self.inference_count = Counter("mlscale_inference_count", "Inferences performed (rows, not requests)",
                                       labels, registry=r)
        self.exec_count = Counter("mlscale_inference_exec_count", "Model executions (batches)", labels, registry=r)
        self.request_duration = Histogram("mlscale_inference_request_duration_seconds",
                                          "End-to-end request time in the server", labels,
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram("mlscale_inference_queue_duration_seconds", "Time waiting in the queue",
                                        labels, buckets=LATENCY_BUCKETS, registry=r)
        self.compute_duration = Histogram("mlscale_inference_compute_infer_duration_seconds",
                                          "Model execution time per batch", labels, buckets=LATENCY_BUCKETS,
                                          registry=r)
        self.batch_size = Histogram("mlscale_inference_batch_size", "Rows per executed batch", labels,
                                    buckets=BATCH_BUCKETS, registry=r)
        self.cache_hits = Counter("mlscale_cache_num_hits_per_model", "Response cache hits", labels, registry=r)
        self.cache_misses = Counter("mlscale_cache_num_misses_per_model", "Response cache misses", labels,
                                    registry=r)
        self.cache_coalesced = Counter("mlscale_cache_num_coalesced_per_model",
                                       "Requests answered by an identical in-flight miss", labels, registry=r)
        self.cache_bytes = Gauge("mlscale_cache_bytes", "Bytes held by the response cache", registry=r)
        self.queue_depth = Gauge("mlscale_inference_pending_request_count", "Requests waiting in the queue", labels,
                                 registry=r)
        self.batch_target = Gauge("mlscale_batch_target", "Batch size the SLO controller aims for", labels,
                                  registry=r)
        self.admission_limit = Gauge("mlscale_admission_limit",
                                     "Most admitted requests in flight, set to keep p99 under --slo-ms", labels,
                                     registry=r)
        self.model_loaded = Gauge("mlscale_model_loaded", "1 for each loaded model version", labels, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelStats:
    """One model version's metric series, bound once (``labels()`` costs a lock and a lookup per call)."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        labels = (model, version)
        self._metrics, self._labels = metrics, labels
        self.success = metrics.request_success.labels(*labels)
        self.duration = metrics.request_duration.labels(*labels)
        self.queue = metrics.queue_duration.labels(*labels)
        self.compute = metrics.compute_duration.labels(*labels)
        self.batch_size = metrics.batch_size.labels(*labels)
        self.inferences = metrics.inference_count.labels(*labels)
        self.executions = metrics.exec_count.labels(*labels)
        self.cache = {"hit": metrics.cache_hits.labels(*labels), "miss": metrics.cache_misses.labels(*labels),
                      "coalesced": metrics.cache_coalesced.labels(*labels)}
        self.queue_depth = metrics.queue_depth.labels(*labels)
        self.batch_target = metrics.batch_target.labels(*labels)
        self.loaded = metrics.model_loaded.labels(*labels)
        self.admission_limit = metrics.admission_limit.labels(*labels)
        self._failures: dict[str, object] = {}

    def failure(self, reason: str) -> None:
        child = self._failures.get(reason)
        if child is None:
            child = self._failures[reason] = self._metrics.request_failure.labels(*self._labels, reason)
        child.inc()  # type: ignore[attr-defined]
