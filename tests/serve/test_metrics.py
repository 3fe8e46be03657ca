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


def test_a_version_held_as_primary_and_canary_keeps_its_role_and_stays_loaded_until_both_let_go():
    from mlscale.serve.metrics import ModelStats

    stats = ModelStats("digits", "2")
    stats.hold("canary")
    assert (stats.role, stats.loaded.value) == ("canary", 1)
    stats.hold("primary")  # promoted: the primary loads the version its canary runs
    assert (stats.role, stats.loaded.value) == ("primary", 1)
    stats.release("primary")  # rolled back: the canary still serves it
    assert (stats.role, stats.loaded.value) == ("canary", 1)
    stats.release("canary")
    assert stats.loaded.value == 0


def test_merged_counters_add_up_workers_and_keep_a_dead_workers_counts_but_not_its_gauges():
    from mlscale.serve.metrics import MetricsView, ServerMetrics

    snapshots = []
    for successes, depth in ((3, 2), (5, 7)):
        metrics = ServerMetrics()
        stats = metrics.stats_for("digits", "1")
        stats.hold("primary")
        stats.success.inc(successes)
        stats.queue_depth.set(depth)
        snapshots.append(metrics.snapshot())
    view = MetricsView.merge([("0", snapshots[0], True), ("1", snapshots[1], False)])
    merged = view.models[("digits", "1")]
    assert merged.success.value == 8 and merged.queue_depth.value == 2  # the dead worker holds nothing now
    assert [worker for worker, _ in view.per_worker] == ["0"]
