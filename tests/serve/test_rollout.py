"""A rollout in one server: a canary's share of requests (exact, sticky per key, moved by a registry tag
without a restart), a shadow answering copies off the response path and compared, and
``mlscale models compare`` gating on both. Neither is reachable but by the split: a request naming a
canary's or a shadow's version is refused, route keys cannot be picked to reach the canary, a bad share
tag changes nothing, and a client's mistakes are not held against a version."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import threading
import time

import httpx
import numpy as np
import pytest

from mlscale.registry import Registry
from mlscale.serve.share import SHARE_TAG
from tests.helpers import free_port, refused, run_cli
from tests.serve.conftest import infer_body, metric, running_server


def _versions(base: str, count: int, key: str | None = None, seed: int = 0) -> dict[str, int]:
    rng, seen = np.random.default_rng(seed), {}
    headers = {"x-route-key": key} if key else {}
    with httpx.Client(timeout=10) as client:
        for _ in range(count):
            answer = client.post(f"{base}/v2/models/digits/infer", headers=headers,
                                 json=infer_body(rng.random((1, 64)).tolist())).json()
            seen[answer["model_version"]] = seen.get(answer["model_version"], 0) + 1
    return seen


def _keyed(base: str, keys: list[str]) -> dict[str, int]:
    """The versions that answer one request by name for each route key."""
    seen: dict[str, int] = {}
    with httpx.Client(timeout=10) as client:
        for key in keys:
            version = client.post(f"{base}/v2/models/digits/infer", headers={"x-route-key": key},
                                  json=infer_body([[0.5] * 64])).json()["model_version"]
            seen[version] = seen.get(version, 0) + 1
    return seen


def _public_bucket(key: str) -> float:
    """A key's place by the unkeyed hash the split used to use: anyone can compute it offline."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % 10_000 / 100


def _wait_for_share(base: str, share: float) -> None:
    deadline = time.time() + 10
    while metric(base, "mlscale_route_share_percent", model="digits", version="2", role="canary") != share:
        assert time.time() < deadline, f"the canary's share did not become {share}"
        time.sleep(0.1)


WRONG_SHAPE = {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [0.5] * 63}]}


def test_a_canary_takes_its_share_sticky_per_key_and_moves_with_the_registry(serve_registry):
    registry = Registry(serve_registry)
    registry.set_alias("digits", 1, "production")
    registry.set_alias("digits", 2, "challenger")
    with running_server(serve_registry, "models:/digits@production", "--canary", "models:/digits@challenger=10",
                        "--reload-interval-s", "0.2", "--cache-mb", "0") as (base, server):
        assert _versions(base, 1000) == {"1": 900, "2": 100}  # unkeyed: an even split, exact
        for key in ("alice", "bob", "carol", "dave", "erin", "frank"):  # keyed: always the same version
            assert len(_versions(base, 5, key=key)) == 1
        # keys picked offline to land below 10 by the public hash: with the server's secret they are keys
        # like any other, about a tenth of them on the canary (all 100 were, with the public hash)
        picked = [key for key in (f"user-{i}" for i in range(3000)) if _public_bucket(key) < 10][:100]
        assert len(picked) == 100
        assert 1 <= _keyed(base, picked).get("2", 0) <= 30

        # only the split reaches a canary: naming its version is refused, saying how to allow it
        named = httpx.post(f"{base}/v2/models/digits/versions/2/infer", json=infer_body([[0.5] * 64]))
        assert named.status_code == 403, named.text
        assert "canary" in named.json()["error"] and "--expose-rollout-versions" in named.json()["error"]
        primary = httpx.post(f"{base}/v2/models/digits/versions/1/infer", json=infer_body([[0.5] * 64]))
        assert primary.json()["model_version"] == "1"  # a version served as primary may be named
        assert httpx.get(f"{base}/v2/models/digits/versions/2").json()["name"] == "digits"  # metadata is no answer

        assert metric(base, "mlscale_route_count_total", model="digits", version="2", role="canary") >= 100
        assert metric(base, "mlscale_route_share_percent", model="digits", version="1", role="primary") == 90
        stats = httpx.get(f"{base}/v2/models/digits/versions/2/stats").json()["model_stats"][0]
        assert stats["parameters"]["role"] == "canary" and stats["parameters"]["routed"] >= 100

        # gRPC: the route key as call metadata, the same bucket as over HTTP
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(server.grpc_address)
        tensor = grpcclient.InferInput("input", [1, 64], "FP32")
        tensor.set_data_from_numpy(np.full((1, 64), 0.5, np.float32))
        over_http = next(iter(_versions(base, 1, key="alice")))
        assert {client.infer("digits", [tensor], headers={"x-route-key": "alice"}).get_response().model_version
                for _ in range(4)} == {over_http}
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as denied:  # model_version naming the canary
            client.infer("digits", [tensor], model_version="2")
        assert "PERMISSION_DENIED" in str(denied.value.status()) and "--expose-rollout-versions" in str(denied.value)
        client.close()

        # the share moves without a restart: the registry's tag, followed as aliases are
        assert run_cli("models", "canary", "digits", "50", "--registry", serve_registry).returncode == 0
        _wait_for_share(base, 50)
        assert _versions(base, 200) == {"1": 100, "2": 100}

        # a client's mistakes: 20 wrong shapes by name (10 routed to each version) and 11 naming the
        # canary (refused) are client errors, counted apart, never a version's failures
        with httpx.Client(timeout=10) as client:
            assert {client.post(f"{base}/v2/models/digits/infer", json=WRONG_SHAPE).status_code
                    for _ in range(20)} == {400}
            assert {client.post(f"{base}/v2/models/digits/versions/2/infer", json=WRONG_SHAPE).status_code
                    for _ in range(11)} == {403}
            rows = {row["version"]: row for row in client.get(f"{base}/v2/models/digits/compare").json()["versions"]}
        for version in ("1", "2"):
            assert metric(base, "mlscale_inference_request_client_error_total", model="digits", version=version,
                          reason="bad_request") == 10
            assert metric(base, "mlscale_inference_request_failure_total", model="digits", version=version,
                          reason="bad_request") == 0
            assert metric(base, "mlscale_route_answer_count_total", model="digits", version=version,
                          role=rows[version]["role"], outcome="client_error") == 10
            assert rows[version]["judged"] == "routed" and rows[version]["failed"] == 0
            assert rows[version]["client_errors"] == 10 and rows[version]["error_rate"] == 0

        # compare: enough answers and no regression passes; too few to judge fails; an unknown challenger is 2
        judged = run_cli("models", "compare", "digits", "challenger", "--server", base)
        assert judged.returncode == 0, judged.stdout + judged.stderr
        assert "every check passed" in judged.stdout and "v2 (canary)" in judged.stdout
        too_few = run_cli("models", "compare", "digits", "2", "--server", base, "--min-requests", "100000")
        assert too_few.returncode == 1 and "FAIL" in too_few.stdout and "NOT ready" in too_few.stdout
        unknown = refused("models", "compare", "digits", "7", "--server", base)
        assert unknown.returncode == 2 and "no canary or shadow '7'" in unknown.stderr

        # a share tag that is no finite number in [0, 100] (as `models tag` wrote any before it refused them)
        # changes nothing: the last good share stays, and each bad text is logged once, not at every poll
        for bad in ("150", "1e999", "-5", "nan"):
            registry.set_tag("digits", None, SHARE_TAG, bad)
            time.sleep(0.5)  # two polls and more (--reload-interval-s 0.2)
            assert metric(base, "mlscale_route_share_percent", model="digits", version="2", role="canary") == 50
        assert _versions(base, 20) == {"1": 10, "2": 10}

        # at a share of 0 the canary answers nothing, asked by name or by its version
        registry.set_tag("digits", None, SHARE_TAG, "0")
        _wait_for_share(base, 0)
        assert _versions(base, 20) == {"1": 20}
        assert httpx.post(f"{base}/v2/models/digits/versions/2/infer", json=infer_body([[0.5] * 64])).status_code == 403
    registry.set_tag("digits", None, SHARE_TAG, "10")
    logged = server.stderr.read()
    for bad in ("150", "1e999", "-5", "nan"):
        assert logged.count(f"{SHARE_TAG}='{bad}'") == 1, logged


def test_a_shadow_answers_copies_off_the_response_path_and_is_compared(serve_registry):
    Registry(serve_registry).set_alias("digits", 1, "production")
    rng = np.random.default_rng(3)
    rows = rng.random((150, 64)).astype(np.float32)
    with running_server(serve_registry, "models:/digits@production", "--shadow", "models:/digits/2",
                        "--no-grpc", "--cache-mb", "0") as (base, _):
        served = []
        with httpx.Client(timeout=10) as client:
            for row in rows:
                answer = client.post(f"{base}/v2/models/digits/infer", json=infer_body([row.tolist()])).json()
                assert answer["model_version"] == "1"  # the shadow's answer is never returned
                served.append(answer["outputs"][0]["data"])
            report = {}
            deadline = time.time() + 10
            while time.time() < deadline:  # copies are answered after the served answers went out
                report = client.get(f"{base}/v2/models/digits/compare").json()
                shadow = next(row for row in report["versions"] if row["role"] == "shadow")["shadow"]
                if shadow["compared"] + shadow["skipped"] + shadow["failed"] == len(rows):
                    break
                time.sleep(0.1)
            named = client.post(f"{base}/v2/models/digits/versions/2/infer", json=infer_body([rows[0].tolist()]))
            assert named.status_code == 403, named.text  # nor is it ever given to a request naming its version
            assert "shadow" in named.json()["error"] and "--expose-rollout-versions" in named.json()["error"]
    from mlscale.serve.runtimes import load_runtime

    registry = Registry(serve_registry)
    version_2 = load_runtime(registry, registry.resolve("models:/digits/2"))
    shadowed = [version_2.run(row[None])[0].tolist() for row in rows]  # what version 2 answers, row by row
    served_a, shadow_a = np.array(served), np.array(shadowed)
    assert shadow["sent"] == len(rows) and shadow["failed"] == 0
    assert shadow["compared"] == len(rows) - shadow["skipped"] >= 100
    if shadow["skipped"] == 0:  # every copy compared: the figures are exactly ours
        expected_agreement = float((served_a.argmax(1) == shadow_a.argmax(1)).mean())
        assert abs(shadow["agreement"] - expected_agreement) < 1e-9
        assert abs(shadow["mean_abs_diff"] - np.abs(served_a - shadow_a).mean()) < 1e-5
    assert 0 < shadow["agreement"] < 1  # two versions trained from other seeds: they disagree somewhere


def test_a_canary_of_another_model_or_of_the_version_served_is_refused(serve_registry):
    for flag, value, says in (("--canary", "models:/digits/2", "must be URI=PERCENT"),
                              ("--canary", "models:/digits/2=150", "between 0 and 100")):
        result = refused("serve", "models:/digits/1", flag, value, "--registry", serve_registry)
        assert result.returncode == 2 and says in result.stderr, (value, result.stderr)
    for flag, value, says in (("--canary", "models:/slow/1=10", "no model named slow is served"),
                              ("--shadow", "models:/digits/1", "which the server holds already")):
        result = run_cli("serve", "models:/digits/1", flag, value, "--no-grpc", "--registry", serve_registry,
                         "--port", str(free_port()))
        assert result.returncode == 2 and says in result.stderr, (value, result.stderr)


def test_exposed_a_named_canary_answers_but_only_what_the_split_routed_is_judged(serve_registry):
    """``--expose-rollout-versions``: a request may name the canary's version (the server's own state,
    in this process: no server to start), and its answers still stay out of what compare judges."""
    from mlscale.serve import ServeOptions
    from mlscale.serve.core import HTTPError, run_inference
    from mlscale.serve.rollout import compare
    from mlscale.serve.server import build_state

    options = ServeOptions(canary="models:/digits/2=50", expose_rollout_versions=True, grpc_port=None, cache_mb=0)
    assert ServeOptions(**options.model_dump(mode="json")).route_secret == options.route_secret  # to each worker
    assert ServeOptions().route_secret != options.route_secret and options.route_secret not in repr(options)
    state = build_state(["models:/digits/1"], options, Registry(serve_registry))
    rows = np.full((1, 64), 0.5, np.float32)

    async def ask(version: str | None) -> str:
        served = state.answering("digits", version)
        if version is None:
            served = state.route(served, None)
        _, answered_by = await run_inference(state, served, rows, {}, time.perf_counter())
        return str(answered_by.number)

    async def scenario() -> tuple[dict, HTTPError]:
        for slot in state.slots:
            await slot.load()
        try:
            assert [await ask("2") for _ in range(3)] == ["2"] * 3  # named: allowed, answered, not judged
            assert sorted([await ask(None) for _ in range(4)]) == ["1", "1", "2", "2"]  # by name: 50%
            state.expose_rollout_versions = False
            with pytest.raises(HTTPError) as refused_:
                state.answering("digits", "2")
            return compare(state, "digits"), refused_.value
        finally:
            for slot in state.slots:
                await slot.current.close()

    report, error = asyncio.run(scenario())
    assert error.status == 403 and "--expose-rollout-versions" in str(error)
    rows_ = {row["version"]: row for row in report["versions"]}
    assert rows_["2"]["role"] == "canary" and rows_["2"]["judged"] == "routed"
    assert rows_["2"]["success"] == 2 and rows_["1"]["success"] == 2  # the 3 named answers are not judged


class _NotAServer(http.server.BaseHTTPRequestHandler):
    """What --server may point at by mistake: a web page, or a proxy's error page."""

    def do_GET(self) -> None:
        status = 502 if "broken" in self.path else 200
        body = b"<html>\n<body>\nnot an mlscale server\n</body>\n</html>\n"
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_compare_against_what_is_no_server_and_a_bad_share_tag_are_one_line(serve_registry):
    site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _NotAServer)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{site.server_address[1]}"
        for server, code in ((base, 2), (f"{base}/broken", 1)):  # not a server of ours: 2; a 5xx: 1
            result = refused("models", "compare", "digits", "2", "--server", server)
            assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1 and "not an mlscale server" in result.stderr
    finally:
        site.shutdown()
        site.server_close()
    for bad in ("150", "inf", "1e999", "-5", "nan", "ten"):  # refused where written, as the servers would
        result = refused("models", "tag", "digits", "0", f"{SHARE_TAG}={bad}", "--registry", serve_registry)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, (bad, result.stderr)
        assert SHARE_TAG in result.stderr
        result = refused("models", "canary", "digits", bad, "--registry", serve_registry)
        assert result.returncode == 2 and "between 0 and 100" in result.stderr, (bad, result.stderr)
    assert Registry(serve_registry).model_tags("digits").get(SHARE_TAG) in (None, "10")  # none was written
