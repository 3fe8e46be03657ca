"""The lock-free metric series render as valid Prometheus exposition with the right values."""

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from mlscale.serve.cache import ResponseCache
from mlscale.serve.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_histograms_and_gauges_render_with_their_labels_and_cumulative_buckets():
    cache = ResponseCache(10_000)
    metrics = ServerMetrics(cache)
    stats = metrics.stats_for("digits", "2")
    for seconds in (0.0004, 0.001, 0.003, 7.0):  # 0.001 sits exactly on a bound: Prometheus buckets are <=
        stats.duration.observe(seconds)
    stats.success.inc()
    stats.cache["hit"].inc(3)
    stats.failure("overloaded")
    stats.failure("overloaded")
    stats.batch_size.observe(64)
    stats.loaded.set(1)
    cache.put(b"k" * 32, np.zeros(10, dtype=np.float32))
    got = samples(metrics)
    labels = (("model", "digits"), ("version", "2"))
    assert got[("mlscale_inference_request_success_total", labels)] == 1
    assert got[("mlscale_cache_num_hits_per_model_total", labels)] == 3
    assert got[("mlscale_inference_request_failure_total", (*labels[:1], ("reason", "overloaded"), labels[1]))] == 2
    bucket = "mlscale_inference_request_duration_seconds_bucket"
    assert got[(bucket, (("le", "0.0005"), *labels))] == 1
    assert got[(bucket, (("le", "0.001"), *labels))] == 2
    assert got[(bucket, (("le", "0.005"), *labels))] == 3
    assert got[(bucket, (("le", "5.0"), *labels))] == 3
    assert got[(bucket, (("le", "+Inf"), *labels))] == 4
    assert got[("mlscale_inference_request_duration_seconds_count", labels)] == 4
    assert abs(got[("mlscale_inference_request_duration_seconds_sum", labels)] - 7.0044) < 1e-9
    assert got[("mlscale_inference_batch_size_bucket", (("le", "32.0"), *labels))] == 0
    assert got[("mlscale_inference_batch_size_bucket", (("le", "64.0"), *labels))] == 1
    assert got[("mlscale_model_loaded", labels)] == 1
    assert got[("mlscale_cache_bytes", ())] == cache.bytes == 40 + 32 + 64
    assert got[("mlscale_cache_max_bytes", ())] == 10_000 and got[("mlscale_cache_entries", ())] == 1


def test_a_version_loaded_again_continues_its_series():
    metrics = ServerMetrics()
    metrics.stats_for("digits", "1").success.inc()
    assert metrics.stats_for("digits", "1").success.value == 1
    assert samples(metrics)[("mlscale_inference_request_success_total", (("model", "digits"), ("version", "1")))] == 1
