"""A language model version's generation series: token latencies, token counts, the engine's sequences,
KV blocks and prefix cache, as ``/metrics`` exports them (labelled model and version, as every series).

The engine reports to them (it is their ``EngineObserver``) from its step thread, their only writer;
they live in the version's cells (``cells.py``), so a server of several workers exports each worker's
tokens, counted up to the scrape, summed exactly. The latencies are vLLM's, per sequence: time to first
token (from the request's arrival at the engine), inter-token latency (between two tokens of a
sequence), time per output token (after the first, averaged over the sequence: (last - first) /
(tokens - 1)). Tokens per second in and out are the rates of the two token counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mlscale.serve.cells import Cells
from mlscale.serve.series import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from mlscale.serve.generation.engine import EngineStats

# seconds; vLLM's buckets for its token latencies, as few as tell a 2 ms step from a 2 s queue
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0, 20.0, 40.0)
# series name -> (metric name, help); counters and gauges follow an EngineStats field of the same stem
HISTOGRAMS = {
    "time_to_first_token": ("mlscale_generation_time_to_first_token_seconds",
                            "From a sequence's arrival at the engine to its first token"),
    "inter_token_latency": ("mlscale_generation_inter_token_latency_seconds",
                            "Between two consecutive tokens of a sequence"),
    "time_per_output_token": ("mlscale_generation_time_per_output_token_seconds",
                              "A sequence's time per token after its first: (last - first) / (tokens - 1)"),
}
COUNTERS = {  # EngineStats field -> (metric name, help)
    "prompt_tokens_total": ("mlscale_generation_prompt_tokens", "Prompt tokens of the sequences received"),
    "generated_tokens_total": ("mlscale_generation_generated_tokens", "Tokens generated"),
    "preemptions_total": ("mlscale_generation_preemptions",
                          "Sequences preempted when the KV pool ran short (recomputed later)"),
    "prefix_queries_total": ("mlscale_generation_prefix_cache_queries",
                             "Full prompt blocks looked up in the prefix cache"),
    "prefix_hits_total": ("mlscale_generation_prefix_cache_hits",
                          "Full prompt blocks found in the prefix cache (their prefill skipped)"),
}
GAUGES = {
    "running": ("mlscale_generation_sequences_running", "Sequences in the running batch"),
    "waiting": ("mlscale_generation_sequences_waiting", "Sequences waiting to join the running batch"),
    "kv_blocks_used": ("mlscale_generation_kv_blocks_used", "KV cache blocks held by sequences"),
    "kv_blocks_total": ("mlscale_generation_kv_blocks_capacity", "KV cache blocks in the pool (--kv-cache-mb)"),
}
SERIES = (*HISTOGRAMS, *COUNTERS, *GAUGES)


class GenerationSeries:
    """One version's generation series, in ``cells`` under ``labels`` (private cells when none)."""

    def __init__(self, labels: list[str], cells: Cells | None = None) -> None:
        cells = cells or Cells()
        self.labels = labels

        def block(name: str, size: int) -> Any:
            return cells.block((*labels, "generation", name), size)

        self.histograms = {name: Histogram(TOKEN_BUCKETS, block(name, len(TOKEN_BUCKETS) + 2))
                           for name in HISTOGRAMS}
        self.counters = {name: Counter(block(name, 1)) for name in COUNTERS}
        self.gauges = {name: Gauge(block(name, 1)) for name in GAUGES}

    # -- the engine's reports (EngineObserver), from its step thread ----------------------------------
    def first_token(self, seconds: float) -> None:
        self.histograms["time_to_first_token"].observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.histograms["inter_token_latency"].observe(seconds)

    def finished(self, seconds_per_token: float) -> None:
        self.histograms["time_per_output_token"].observe(seconds_per_token)

    def engine(self, before: EngineStats, now: EngineStats) -> None:
        """The engine's counters moved from ``before`` to ``now`` (added: a version loaded again later,
        with an engine that counts from 0, continues its counters), its gauges are ``now``'s."""
        for name, counter in self.counters.items():
            counter.inc(getattr(now, name) - getattr(before, name))
        for name, gauge in self.gauges.items():
            gauge.set(getattr(now, name))

    # -- a worker's snapshot, merged into the whole server's ------------------------------------------
    def snapshot(self) -> dict[str, list[float]]:
        """Each series' cells (a histogram's buckets then its sum), as a worker's cells file holds them."""
        out = {name: [*histogram.counts, histogram.sum] for name, histogram in self.histograms.items()}
        out.update({name: [series.value] for name, series in (*self.counters.items(), *self.gauges.items())})
        return out

    def absorb(self, snapshot: dict[str, list[float]], gauges: bool = True) -> None:
        """Another worker's series added to these; its gauges too unless ``gauges`` is False (it is gone)."""
        for name, values in snapshot.items():
            if name in self.histograms:
                self.histograms[name].add([int(v) for v in values[:-1]], values[-1])
            elif name in self.counters:
                self.counters[name].inc(values[0])
            elif name in self.gauges and gauges:
                self.gauges[name].inc(values[0])


def families(totals: list[GenerationSeries], per_worker: list[tuple[list[str], GenerationSeries]],
             gauge_labels: list[str]) -> Iterator[Metric]:
    """The generation families: histograms and counters of the whole server (``totals``), gauges per live
    worker (``per_worker``: each one's labels, as ``gauge_labels`` names them)."""
    labels = ["model", "version"]
    for name, (metric, doc) in HISTOGRAMS.items():
        histogram_family = HistogramMetricFamily(metric, doc, labels=labels)
        for series in totals:
            histogram = series.histograms[name]
            histogram_family.add_metric(series.labels, histogram.buckets(), histogram.sum)
        yield histogram_family
    for name, (metric, doc) in COUNTERS.items():
        counter_family = CounterMetricFamily(metric, doc, labels=labels)
        for series in totals:
            counter_family.add_metric(series.labels, series.counters[name].value)
        yield counter_family
    for name, (metric, doc) in GAUGES.items():
        gauge_family = GaugeMetricFamily(metric, doc, labels=gauge_labels)
        for worker_labels, series in per_worker:
            gauge_family.add_metric(worker_labels, series.gauges[name].value)
        yield gauge_family
