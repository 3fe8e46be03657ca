"""Operating a server that generates: /metrics (token latencies, tokens, sequences, KV blocks, prefix
cache) summed exactly over workers, an alias moved to a new version, a drain that lets streams finish,
a canary's share, a shadow's agreement and the spans of a request. Real server processes, a tiny Llama
from a ``transformers`` config without a tokenizer (token ids in and out): version 1, version 2 (other
weights) and version 3 (version 1's weights again), ``@prod`` on version 1."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlscale.registry import Registry, register_run
from mlscale.serve.generation.engine import IDLE, EngineStats
from mlscale.serve.generation.responses import same_tokens
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.peers import Peers
from tests.helpers import shared_copy
from tests.serve.conftest import metric, running_server
from tests.serve.generation.test_endpoints import _run
from tests.serve.test_tracing import CALLER_SPAN, TRACE_ID, Receiver

pytestmark = pytest.mark.timeout(300)
CONTEXT = 256


def _build(root):
    registry = Registry(str(root / "registry"))
    first = _run(root / "first", "tests.user_models:llama", {"seq_len": CONTEXT, "samples": 16})
    other = _run(root / "other", "tests.user_models:llama", {"seq_len": CONTEXT, "samples": 16}, seed=8)
    for run in (first, other, first):  # versions 1, 2 (other weights), 3 (version 1's weights)
        register_run(registry, run, "lm")
    registry.set_alias("lm", 1, "prod")


@pytest.fixture(scope="module")
def location(tmp_path_factory):
    return str(shared_copy(tmp_path_factory, "operations", _build) / "registry")


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/HTTP receiver of the spans a server exports."""
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    yield receiver
    receiver.shutdown()


@pytest.fixture(scope="module")
def rollout(location, receiver):
    """Version 1 served, version 2 its canary for half of the requests by name, version 3 (version 1's
    weights) its shadow; spans exported to ``receiver``."""
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms, not every 5 s
        with running_server(location, "models:/lm/1", "--canary", "models:/lm/2=50", "--shadow", "models:/lm/3",
                            "--otlp-endpoint", endpoint, "--no-grpc", "--cache-mb", "0") as (base, _):
            yield base


@pytest.fixture(scope="module")
def workers(location):
    """Two workers serving ``@prod``, checked every 0.2 s."""
    with running_server(location, "models:/lm@prod", "--workers", "2", "--no-grpc", "--cache-mb", "0",
                        "--reload-interval-s", "0.2") as (base, process):
        yield base, process


def generate(base: str, ids: list[int], max_tokens: int, version: str | None = None, **parameters) -> dict:
    """One greedy OIP generate of exactly ``max_tokens`` tokens (the end id ignored), on a new connection."""
    path = f"/v2/models/lm/versions/{version}/generate" if version else "/v2/models/lm/generate"
    body = {"input_ids": ids, "parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                             **parameters}}
    response = httpx.post(base + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _samples(base: str, prefix: str) -> dict[str, float]:
    """Every sample of the families whose name starts with ``prefix``, by its line's name and labels."""
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith(prefix)}


GENERATION = ("prompt_tokens_total", "generated_tokens_total", "time_to_first_token_seconds_count",
              "inter_token_latency_seconds_count", "time_per_output_token_seconds_count",
              "prefix_cache_queries_total", "prefix_cache_hits_total")


def _generation_counts(base: str, version: str) -> dict[str, float]:
    return {name: metric(base, f"mlscale_generation_{name}", model="lm", version=version) for name in GENERATION}


def test_metrics_count_every_workers_tokens_and_latencies_exactly(workers):
    base, _ = workers
    version = generate(base, [1, 2, 3], 1)["model_version"]  # what @prod serves now
    before = _generation_counts(base, version)
    shared = list(range(1, 17)) * 2  # two full KV blocks every prompt shares, then 1..12 tokens of its own
    prompts = [shared + [1 + i % 20] * (1 + i) for i in range(12)]
    with ThreadPoolExecutor(4) as pool:  # each on a new connection: both workers answer some
        answers = list(pool.map(lambda ids: generate(base, ids, 5), prompts))
    assert all(len(a["output_ids"]) == 5 and a["model_version"] == version for a in answers)
    after = _generation_counts(base, version)
    counted = {name: after[name] - before[name] for name in GENERATION}
    assert counted == {**counted, "prompt_tokens_total": sum(map(len, prompts)), "generated_tokens_total": 60,
                       "time_to_first_token_seconds_count": 12, "inter_token_latency_seconds_count": 48,
                       "time_per_output_token_seconds_count": 12, "prefix_cache_queries_total": 24}
    assert 0 < counted["prefix_cache_hits_total"] <= 24  # the shared blocks, once a worker has computed them
    gauges = _samples(base, "mlscale_generation_kv_blocks_capacity{")
    assert sorted(key.split('worker="')[1][0] for key in gauges) == ["0", "1"]  # a gauge per live worker
    assert all(value > 0 for value in gauges.values())
    for gauge in ("sequences_running", "sequences_waiting", "kv_blocks_used"):
        assert len(_samples(base, f"mlscale_generation_{gauge}{{")) == 2


def test_a_new_version_behind_the_alias_answers_after_reload_in_every_worker(workers, location):
    base, _ = workers
    prompt = [5, 6, 7, 8]
    old = generate(base, prompt, 8)
    new = "2" if old["model_version"] == "1" else "1"  # versions 1 and 2 have other weights
    Registry(location).set_alias("lm", int(new), "prod")
    deadline, answers = time.time() + 60, []
    while len(answers) < 8:  # eight in a row from the new version, each on a new connection: both workers
        assert time.time() < deadline, "the alias's new version never answered in every worker"
        answer = generate(base, prompt, 8)
        answers = [*answers, answer] if answer["model_version"] == new else []
    assert all(a["output_ids"] == answers[0]["output_ids"] != old["output_ids"] for a in answers)
    kept = metric(base, "mlscale_generation_generated_tokens_total", model="lm", version=old["model_version"])
    assert kept >= 8  # the old version's counters stay; its engine is closed and holds nothing
    blocks = _samples(base, f'mlscale_generation_kv_blocks_capacity{{model="lm",version="{old["model_version"]}"')
    assert list(blocks.values()) == [0.0, 0.0]


def _stream(base: str, body: dict):
    """The events of a generate_stream as they come, each with when it came."""
    with httpx.stream("POST", f"{base}/v2/models/lm/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[len("data: "):]), time.perf_counter()


def test_sigterm_lets_the_streams_in_flight_finish_then_exits_0(location):
    tokens = CONTEXT - 6
    body = {"input_ids": [1, 2, 3, 4], "parameters": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    with running_server(location, "models:/lm/1", "--no-grpc") as (base, process):
        with ThreadPoolExecutor(2) as pool:
            streams = [_stream(base, body) for _ in range(2)]
            firsts = list(pool.map(next, streams))  # both streams have begun
            process.send_signal(signal.SIGTERM)
            signalled = time.perf_counter()
            rests = list(pool.map(list, streams))
        assert process.wait(timeout=30) == 0
    for first, rest in zip(firsts, rests):
        events = [first[0], *(event for event, _ in rest)]
        assert rest[-1][1] - signalled > 0.1  # read as they came: the stream was still generating at the signal
        assert sum(len(e["output_ids"]) for e in events) == tokens
        assert events[-1]["done"] and events[-1]["details"]["finish_reason"] == "length"


def test_a_canary_answers_its_share_of_generation_requests_and_is_judged_on_them(rollout):
    base = rollout
    versions = [generate(base, [9, 8, 7], 4)["model_version"] for _ in range(10)]
    assert sorted(versions) == ["1"] * 5 + ["2"] * 5  # 50%: every other request by name, exactly
    chat = httpx.post(f"{base}/v1/completions", json={"model": "lm", "prompt": [9, 8, 7], "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
    assert chat.status_code == 200
    rows = {row["version"]: row for row in httpx.get(f"{base}/v2/models/lm/compare", timeout=10).json()["versions"]}
    assert rows["2"]["role"] == "canary" and rows["2"]["success"] >= 5 and rows["2"]["failed"] == 0
    assert rows["1"]["success"] >= 5


def _shadow(base: str) -> dict:
    rows = httpx.get(f"{base}/v2/models/lm/compare", timeout=10).json()["versions"]
    return next(row["shadow"] for row in rows if row["role"] == "shadow")


def test_the_shadows_agreement_is_the_share_of_identical_greedy_outputs(rollout):
    base = rollout
    before = _shadow(base)
    for i in range(4):  # naming version 1: the split leaves them to it, the shadow gets a copy of each
        generate(base, [3 + i, 4, 5], 6, version="1")
    generate(base, [3, 4, 5], 6, version="1", temperature=1.0)  # sampled: nothing to compare, not copied
    deadline = time.time() + 30
    while (after := _shadow(base))["compared"] < before["compared"] + 4:
        assert time.time() < deadline, after
        time.sleep(0.1)
    assert after["sent"] - before["sent"] == 4 and after["failed"] == 0
    assert after["agreement"] == 1.0 and after["mean_abs_diff"] == 0.0  # version 3 has version 1's weights
    assert same_tokens([[1, 2, 3], [4]], [[1, 2, 3], [4]]) == (True, 0.0)
    assert same_tokens([[1, 2, 3], [4]], [[1, 2, 9], [4, 5]]) == (False, 2 / 5)  # a token other, a token more


def test_a_generation_requests_span_continues_the_callers_trace_with_queue_prefill_and_decode(rollout, receiver):
    base = rollout
    body = {"input_ids": [2, 3, 4, 5], "parameters": {"max_tokens": 6, "temperature": 0.5, "ignore_eos": True}}
    with httpx.stream("POST", f"{base}/v2/models/lm/versions/1/generate_stream", json=body, timeout=60,
                      headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}) as response:
        returned = response.headers["traceparent"].split("-")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert returned[1] == TRACE_ID and len(events) == 6
    spans = receiver.wait_for(lambda spans: any(s.span_id.hex() == returned[2] for s in spans))
    (root,) = [s for s in spans if s.span_id.hex() == returned[2]]
    assert root.name == "generate lm" and root.parent_span_id.hex() == CALLER_SPAN
    assert {a.key: a.value.string_value for a in root.attributes}["mlscale.version"] == "1"
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert {"admission", "queue", "prefill", "decode"} <= set(children), set(children)
    queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
    assert root.start_time_unix_nano <= queue.start_time_unix_nano  # one after the other, within the request
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano <= decode.end_time_unix_nano
    assert decode.end_time_unix_nano <= root.end_time_unix_nano
    assert {a.key: a.value.int_value for a in decode.attributes}["mlscale.completion_tokens"] == 6


def test_a_dead_workers_generation_counters_are_kept_and_its_gauges_dropped(tmp_path):
    """The merge a scrape does over workers' cells files, one worker retired (dead) in between."""
    workers = []
    for index in range(2):
        metrics = ServerMetrics(peers=Peers(tmp_path, 2, index=index))
        series = metrics.stats_for("lm", "1").generating()
        series.first_token(0.01)
        series.engine(IDLE, EngineStats(running=1, waiting=0, preemptions_total=0, kv_blocks_used=2,
                                        kv_blocks_total=8, prefix_queries_total=4, prefix_hits_total=3,
                                        prompt_tokens_total=10, generated_tokens_total=5))
        workers.append(metrics)
    both = workers[0].view().models[("lm", "1")].generation
    assert (both.counters["prompt_tokens_total"].value, both.histograms["time_to_first_token"].count) == (20, 2)
    workers[0].peers.retire(1)
    view = workers[0].view()
    kept = view.models[("lm", "1")].generation
    assert (kept.counters["prompt_tokens_total"].value, kept.counters["prefix_hits_total"].value) == (20, 6)
    assert kept.histograms["time_to_first_token"].count == 2
    assert [stats.generation.gauges["running"].value for _, stats in view.per_worker] == [1]  # the live one
