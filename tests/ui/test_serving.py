"""The serving view's data for a language model: what the UI computes from a server's own /metrics text
(the exporter's, for a version whose engine reported tokens), scraped over HTTP twice, a second apart."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlscale.serve.generation.engine import EngineStats
from mlscale.serve.metrics import ServerMetrics
from mlscale.ui.serving import MIN_INTERVAL_S, ServerWatch

pytestmark = pytest.mark.timeout(60)


def _serving(metrics: ServerMetrics) -> ThreadingHTTPServer:
    """/metrics rendered by ``metrics`` at each scrape; statistics naming versions lm/1 and digits/1."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics.render() if self.path == "/metrics" else json.dumps({"model_stats": [
                {"name": "lm", "version": "1"}, {"name": "digits", "version": "1"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_language_models_generation_figures_reach_the_serving_view():
    metrics = ServerMetrics()
    metrics.stats_for("digits", "1")  # a tensor model: no generation row
    series = metrics.stats_for("lm", "1").generating()
    idle = EngineStats(0, 0, 0, 0, 100, 0, 0, 0, 0)
    series.engine(EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0), idle)
    server = _serving(metrics)
    try:
        watch = ServerWatch(f"http://127.0.0.1:{server.server_address[1]}", 100.0)
        first = {v["model"]: v for v in watch.poll()["versions"]}
        assert first["digits"]["generation"] is None
        assert first["lm"]["generation"]["kv_blocks"] == 100 and first["lm"]["generation"]["ttft_ms"]["p50"] is None
        for _ in range(10):  # ten sequences: 30 ms to the first token, then 4 tokens 5 ms apart
            series.first_token(0.03)
            for _ in range(4):
                series.next_token(0.005)
            series.finished(0.005)
        series.engine(idle, EngineStats(running=3, waiting=2, preemptions_total=1, kv_blocks_used=25,
                                        kv_blocks_total=100, prefix_queries_total=40, prefix_hits_total=30,
                                        prompt_tokens_total=200, generated_tokens_total=50))
        time.sleep(MIN_INTERVAL_S)
        view = watch.poll()
    finally:
        server.shutdown()
        server.server_close()
    lm = next(v for v in view["versions"] if v["model"] == "lm")["generation"]
    span = view["interval_s"]
    assert (lm["prompt_tokens_per_s"], lm["generated_tokens_per_s"]) == pytest.approx((200 / span, 50 / span))
    assert 20 < lm["ttft_ms"]["p50"] <= 40 and 2.5 < lm["itl_ms"]["p99"] <= 5 and 2.5 < lm["tpot_ms"]["p50"] <= 5
    assert (lm["running"], lm["waiting"], lm["preemptions"]) == (3, 2, 1)
    assert (lm["kv_blocks_used"], lm["kv_blocks"], lm["kv_usage"], lm["prefix_hit_rate"]) == (25, 100, 0.25, 0.75)
