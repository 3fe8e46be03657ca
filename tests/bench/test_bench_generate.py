"""The generate benchmark runs end to end (--quick: a tiny Llama, a few short requests; mlscale registered
and asked through mlscale serve's streaming endpoint) and writes JSON + PNG: every system answers every
request with all its tokens, measured as vLLM's benchmark defines it, and the targets' ratios are stated."""

import json

from mlscale.cli import main


def test_bench_generate_quick_measures_every_system_and_writes_json_and_png(tmp_path):
    assert main(["bench", "generate", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "generate.json").read_text())
    assert list(result["systems"]) == ["floor", "static", "hf_cb", "mlscale"]
    assert result["mlscale_transport"].startswith("mlscale serve")  # streamed over HTTP, as a user asks
    slo = result["slo"]
    assert slo["slo_ttft_ms"] == slo["slo_scale"] * slo["solo_p50_ttft_ms"] > 0
    for load in result["loads"]:
        for name, figures in load["systems"].items():
            assert (name, figures["completed"], figures["failed"]) == (name, result["workload"]["requests"], 0)
            for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                assert 0 < figures[metric]["p50"] <= figures[metric]["p99"], (name, metric)
            assert 0 <= figures["goodput"] <= figures["request_throughput"]
            assert figures["output_throughput"] > figures["request_throughput"]
    prefix = result["prefix"]
    assert prefix["with_cache"]["completed"] == prefix["without_cache"]["completed"] == prefix["requests"]
    assert prefix["p50_ttft_with_vs_without"] > 0
    for key in ("goodput_vs_static", "goodput_vs_hf_cb", "prefix_ttft_with_vs_without"):
        assert {"ratio", "target", "met"} <= set(result["targets"][key])
    assert (tmp_path / "generate.png").read_bytes()[:4] == b"\x89PNG"
