"""Live serving, as the UI shows it: each ``--server`` scraped (``/metrics`` and ``/v2/models/stats``, the
server's own numbers), rates and percentiles computed over the interval between two scrapes.

A scrape happens when a page asks, at most once a ``MIN_INTERVAL_S`` per server whoever asks (pages share
it), and the last ``HISTORY`` results are kept for the time series. Nothing here knows how the server
works inside: only what any Prometheus scraper would see.

A scraped server is untrusted like any input: one scrape (both of its requests) has a deadline for the
whole of it, ``SCRAPE_DEADLINE_S``, not a timeout per read that a server sending a byte a second renews
for ever, and reads at most ``MAX_SCRAPE_BYTES``; past either the server is shown "too slow" or "too large",
and at most one scrape per server is in flight, so a slow server costs one thread, not one per page.
"""

from __future__ import annotations

import http.client
import math
import ssl
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from mlscale.common.redact import redact_url

MIN_INTERVAL_S = 1.0
HISTORY = 300  # scrapes kept per server (5 minutes at one a second)
SCRAPE_DEADLINE_S = 3.0  # one whole scrape: /metrics and the statistics, headers and bodies
MAX_SCRAPE_BYTES = 4 << 20  # one response's body (mlscale's own /metrics is tens of kB)


class ScrapeRefused(Exception):
    """A scrape given up: the short reason the page shows."""


def fetch(url: str, deadline: float, limit: int = MAX_SCRAPE_BYTES) -> bytes:
    """GET ``url``'s body, all of it by ``deadline`` (``time.monotonic``) and at most ``limit`` bytes:
    each read waits only for the time left, so a server trickling bytes cannot stretch the scrape."""
    parts = urllib.parse.urlsplit(url)
    left = deadline - time.monotonic()
    if left <= 0:
        raise ScrapeRefused("too slow")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    extra = {"context": ssl.create_default_context()} if parts.scheme == "https" else {}
    connection = kind(parts.hostname or "", parts.port, timeout=left, **extra)
    try:
        connection.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                           headers={"accept": "*/*", "connection": "close"})
        response = connection.getresponse()
        if response.status != 200:
            raise ScrapeRefused(f"HTTP {response.status}")
        declared = response.getheader("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ScrapeRefused("too large")
        chunks, size = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ScrapeRefused("too slow")
            if connection.sock is not None:
                connection.sock.settimeout(left)
            chunk = response.read1(64 * 1024)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise ScrapeRefused("too large")
            chunks.append(chunk)
    except TimeoutError:
        raise ScrapeRefused("too slow") from None
    finally:
        connection.close()

Key = tuple[str, str]  # (model, version)


@dataclass
class Scrape:
    """One scrape's raw numbers: counters and gauges by (family, labels), histograms as cumulative buckets."""

    at: float
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    stats: list[dict[str, Any]] = field(default_factory=list)

    def has(self, name: str, **labels: str) -> bool:
        """Some series of ``name`` has ``labels``."""
        want = set(labels.items())
        return any(n == name and want <= set(ls) for n, ls in self.samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum over every series of ``name`` whose labels include ``labels`` (0 if none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))

    def label_values(self, name: str, label: str, *, mean: bool = False, **labels: str) -> dict[str, float]:
        """``name`` summed (``mean``: averaged, a gauge each worker reports) by the value of ``label``,
        over series that include ``labels``."""
        want, out, seen = set(labels.items()), {}, {}
        for (n, ls), v in self.samples.items():
            if n == name and want <= set(ls):
                key = dict(ls).get(label)
                if key is not None:
                    out[key] = out.get(key, 0.0) + v
                    seen[key] = seen.get(key, 0) + 1
        return {key: value / seen[key] for key, value in out.items()} if mean else out

    def buckets(self, family: str, **labels: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets (upper bound, count), summed over matching series."""
        by_le = self.label_values(f"{family}_bucket", "le", **labels)
        return sorted((float(le), count) for le, count in by_le.items())


def parse_scrape(metrics_text: str, stats: list[dict[str, Any]], at: float) -> Scrape:
    scrape = Scrape(at, stats=stats)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")  # a counter's sample, by its family's name
            key = (name, tuple(sorted(sample.labels.items())))
            scrape.samples[key] = scrape.samples.get(key, 0.0) + float(sample.value)
    return scrape


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the q-th observation falls in (None
    without observations; the last finite bound when it falls in +Inf)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total, previous_bound, previous_count = buckets[-1][1], 0.0, 0.0
    rank = q * total
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            inside = count - previous_count
            return previous_bound + (bound - previous_bound) * ((rank - previous_count) / inside if inside else 1.0)
        previous_bound, previous_count = bound, count
    return previous_bound


def fraction_within(buckets: list[tuple[float, float]], bound_s: float) -> float | None:
    """The fraction of observations at or under ``bound_s`` (linear within its bucket), None without any."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in buckets:
        if bound >= bound_s:
            part = 1.0 if math.isinf(bound) else (bound_s - previous_bound) / (bound - previous_bound)
            return (previous_count + (count - previous_count) * part) / buckets[-1][1]
        previous_bound, previous_count = bound, count
    return 1.0


def _delta_buckets(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The observations between two scrapes; a histogram that went down (the server restarted) counts
    from zero again, as Prometheus' rate() does."""
    old = dict(before)
    if now and before and now[-1][1] < before[-1][1]:
        return now
    return [(bound, max(0.0, count - old.get(bound, 0.0))) for bound, count in now]


def _increase(now: float, before: float) -> float:
    """A counter's increase between two scrapes (from zero again after a reset)."""
    return now - before if now >= before else now


class ServerWatch:
    """One ``--server``: its scrapes and what the page draws from them."""

    def __init__(self, url: str, slo_ms: float) -> None:
        self.url, self.slo_s = url.rstrip("/"), slo_ms / 1e3
        self.shown = redact_url(self.url)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._previous: Scrape | None = None
        self._latest: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def poll(self) -> dict[str, Any]:
        """The server now: scraped unless the last scrape is under a second old; while one scrape is in
        flight (a slow or unreachable server), everyone else gets the last result instead of waiting
        (the first poll waits at most one scrape's deadline)."""
        if not self._lock.acquire(timeout=SCRAPE_DEADLINE_S + 0.5 if self._latest is None else 0):
            return self._latest or {"url": self.shown, "at": time.time(), "up": False, "error": "scraping"}
        try:
            if self._latest is not None and time.time() - self._latest["at"] < MIN_INTERVAL_S:
                return self._latest
            try:
                scrape = self._scrape()
            except (OSError, ScrapeRefused, ValueError, http.client.HTTPException) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
                self._latest = {"url": self.shown, "at": time.time(), "up": False, "error": reason[:200],
                                "history": list(self.history)}
                return self._latest
            view = self._view(scrape, self._previous)
            self._previous = scrape
            self.history.append(view["point"])
            self._latest = {**view, "history": list(self.history)}
            return self._latest
        finally:
            self._lock.release()

    def _scrape(self) -> Scrape:
        """Both requests within one deadline; the statistics checked for the shape the view reads."""
        deadline = time.monotonic() + SCRAPE_DEADLINE_S
        text = fetch(self.url + "/metrics", deadline).decode("utf-8", "replace")
        answer = orjson.loads(fetch(self.url + "/v2/models/stats", deadline))
        stats = answer.get("model_stats") if isinstance(answer, dict) else None
        stats = [entry for entry in stats if isinstance(entry, dict)] if isinstance(stats, list) else []
        return parse_scrape(text, stats, time.time())

    def _view(self, now: Scrape, before: Scrape | None) -> dict[str, Any]:
        span = (now.at - before.at) if before is not None else None
        versions = []
        for entry in now.stats[:256]:
            name, version = str(entry.get("name", ""))[:200], str(entry.get("version", ""))[:64]
            parameters = entry.get("parameters")
            versions.append(self._version(now, before, span, name, version,
                                          parameters if isinstance(parameters, dict) else {}))
        totals = {key: sum(v[key] or 0.0 for v in versions) if before is not None else None  # rates need two
                  for key in ("goodput_per_s", "answered_per_s", "failed_per_s")}
        latency_now = now.buckets("mlscale_inference_request_duration_seconds")
        latency = _delta_buckets(latency_now, before.buckets("mlscale_inference_request_duration_seconds")) \
            if before is not None else latency_now
        point = {"at": now.at, **totals,
                 "p50_ms": _ms(quantile(latency, 0.5)), "p99_ms": _ms(quantile(latency, 0.99)),
                 "queue": now.value("mlscale_inference_pending_request_count")}
        refused = now.label_values("mlscale_http_request_refused", "reason")
        return {"url": self.shown, "at": now.at, "up": True, "interval_s": span, "slo_ms": self.slo_s * 1e3,
                "versions": versions,
                "point": point, "refused": refused,
                "cache_bytes": now.value("mlscale_cache_bytes"), "cache_entries": now.value("mlscale_cache_entries")}

    def _version(self, now: Scrape, before: Scrape | None, span: float | None, name: str, version: str,
                 parameters: dict[str, Any]) -> dict[str, Any]:
        labels = {"model": name, "version": version}

        def rate(family: str, **extra: str) -> float | None:
            if before is None or not span:
                return None
            return _increase(now.value(family, **labels, **extra), before.value(family, **labels, **extra)) / span

        def interval(family: str) -> list[tuple[float, float]]:
            buckets = now.buckets(family, **labels)
            return _delta_buckets(buckets, before.buckets(family, **labels)) if before is not None else buckets

        latency = interval("mlscale_inference_request_duration_seconds")
        batches = interval("mlscale_inference_batch_size")
        hits = now.value("mlscale_cache_num_hits_per_model", **labels)
        misses = now.value("mlscale_cache_num_misses_per_model", **labels)
        if before is not None:
            hits = _increase(hits, before.value("mlscale_cache_num_hits_per_model", **labels))
            misses = _increase(misses, before.value("mlscale_cache_num_misses_per_model", **labels))
        skew = now.label_values("mlscale_feature_skew", "feature", mean=True, **labels)  # one per worker
        role = _parameter(parameters.get("role"))
        role = role[:32] if isinstance(role, str) else None
        answered, within = rate("mlscale_inference_request_success"), fraction_within(latency, self.slo_s)
        return {
            "model": name, "version": version, "role": role or "primary",
            "goodput_per_s": None if answered is None else answered * (within if within is not None else 1.0),
            "share_percent": now.value("mlscale_route_share_percent", **labels),
            "answered_per_s": answered,
            "failed_per_s": rate("mlscale_inference_request_failure"),
            "routed_per_s": rate("mlscale_route_count"),
            "answered": now.value("mlscale_inference_request_success", **labels),
            "latency_ms": {q: _ms(quantile(latency, p)) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "batch_sizes": _histogram_counts(batches),
            "queue": now.value("mlscale_inference_pending_request_count", **labels),
            "cache_hit_rate": hits / (hits + misses) if hits + misses > 0 else None,
            "skew": dict(sorted(skew.items())),
            "generation": _generation(now, before, span, labels),
        }


def _generation(now: Scrape, before: Scrape | None, span: float | None,
                labels: dict[str, str]) -> dict[str, Any] | None:
    """A language model version's text generation (None for any other): token latencies over the interval,
    tokens per second in and out, sequences running and waiting, preemptions, KV blocks and the prefix
    cache's hit rate (the share of full prompt blocks found cached), from ``mlscale_generation_*``."""
    if not now.has("mlscale_generation_kv_blocks_capacity", **labels):
        return None

    def increase(family: str) -> float:
        value = now.value(family, **labels)
        return _increase(value, before.value(family, **labels)) if before is not None else value

    def latency(family: str) -> dict[str, float | None]:
        buckets = now.buckets(family, **labels)
        if before is not None:
            buckets = _delta_buckets(buckets, before.buckets(family, **labels))
        return {q: _ms(quantile(buckets, p)) for q, p in (("p50", 0.5), ("p99", 0.99))}

    used, blocks = (now.value(f"mlscale_generation_kv_blocks_{kind}", **labels) for kind in ("used", "capacity"))
    queries, hits = (increase(f"mlscale_generation_prefix_cache_{kind}") for kind in ("queries", "hits"))

    def per_s(family: str) -> float | None:  # a rate needs two scrapes
        return increase(family) / span if before is not None and span else None

    return {
        "ttft_ms": latency("mlscale_generation_time_to_first_token_seconds"),
        "itl_ms": latency("mlscale_generation_inter_token_latency_seconds"),
        "tpot_ms": latency("mlscale_generation_time_per_output_token_seconds"),
        "prompt_tokens_per_s": per_s("mlscale_generation_prompt_tokens"),
        "generated_tokens_per_s": per_s("mlscale_generation_generated_tokens"),
        "running": now.value("mlscale_generation_sequences_running", **labels),
        "waiting": now.value("mlscale_generation_sequences_waiting", **labels),
        "preemptions": now.value("mlscale_generation_preemptions", **labels),
        "kv_blocks_used": used, "kv_blocks": blocks, "kv_usage": used / blocks if blocks else None,
        "prefix_hit_rate": hits / queries if queries else None,
    }


def _parameter(value: Any) -> Any:
    """A statistics parameter, whether plain or in the protocol's typed form ({"string_param": ...})."""
    if isinstance(value, dict) and value:
        return next(iter(value.values()))
    return value


def _histogram_counts(buckets: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Cumulative buckets as counts per bucket (``le`` its upper bound), empty ones left out."""
    out, previous = [], 0.0
    for bound, count in buckets:
        inside = count - previous
        previous = count
        if inside > 0:
            out.append({"le": "+Inf" if math.isinf(bound) else f"{bound:g}", "count": inside})
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


class ServerBoard:
    """Every ``--server``, polled together (each in a thread: one slow server delays no other)."""

    def __init__(self, urls: list[str], slo_ms: float = 100.0) -> None:
        self.watches = [ServerWatch(url, slo_ms) for url in urls]

    def poll(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | None] = [None] * len(self.watches)

        def one(i: int) -> None:
            results[i] = self.watches[i].poll()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(self.watches))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SCRAPE_DEADLINE_S + 1)
        return [r or {"url": w.shown, "up": False, "error": "no answer"} for r, w in zip(results, self.watches)]
