"""A rollout in one server: a canary's share of requests (exact, sticky per key, moved by a registry tag
without a restart), a shadow answering copies off the response path and compared, and
``mlscale models compare`` gating on both."""

from __future__ import annotations

import time

import httpx
import numpy as np

from mlscale.registry import Registry
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


def test_a_canary_takes_its_share_sticky_per_key_and_moves_with_the_registry(serve_registry):
    registry = Registry(serve_registry)
    registry.set_alias("digits", 1, "production")
    registry.set_alias("digits", 2, "challenger")
    with running_server(serve_registry, "models:/digits@production", "--canary", "models:/digits@challenger=10",
                        "--reload-interval-s", "0.2", "--cache-mb", "0") as (base, server):
        assert _versions(base, 1000) == {"1": 900, "2": 100}  # unkeyed: an even split, exact
        for key in ("alice", "bob", "carol", "dave", "erin", "frank"):  # keyed: always the same version
            assert len(_versions(base, 5, key=key)) == 1
        explicit = httpx.post(f"{base}/v2/models/digits/versions/2/infer",
                              json=infer_body([[0.5] * 64])).json()["model_version"]
        assert explicit == "2"  # a request naming its version is never split

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
        client.close()

        # the share moves without a restart: the registry's tag, followed as aliases are
        assert run_cli("models", "canary", "digits", "50", "--registry", serve_registry).returncode == 0
        deadline = time.time() + 10
        while metric(base, "mlscale_route_share_percent", model="digits", version="2", role="canary") != 50:
            assert time.time() < deadline, "the canary's share did not follow the registry tag"
            time.sleep(0.1)
        assert _versions(base, 200) == {"1": 100, "2": 100}

        # compare: enough answers and no regression passes; too few to judge fails; an unknown challenger is 2
        judged = run_cli("models", "compare", "digits", "challenger", "--server", base)
        assert judged.returncode == 0, judged.stdout + judged.stderr
        assert "every check passed" in judged.stdout and "v2 (canary)" in judged.stdout
        too_few = run_cli("models", "compare", "digits", "2", "--server", base, "--min-requests", "100000")
        assert too_few.returncode == 1 and "FAIL" in too_few.stdout and "NOT ready" in too_few.stdout
        unknown = refused("models", "compare", "digits", "7", "--server", base)
        assert unknown.returncode == 2 and "no canary or shadow '7'" in unknown.stderr
    Registry(serve_registry).set_tag("digits", None, "mlscale.canary_percent", "10")


def test_a_shadow_answers_copies_off_the_response_path_and_is_compared(serve_registry):
    Registry(serve_registry).set_alias("digits", 1, "production")
    rng = np.random.default_rng(3)
    rows = rng.random((150, 64)).astype(np.float32)
    with running_server(serve_registry, "models:/digits@production", "--shadow", "models:/digits/2",
                        "--no-grpc", "--cache-mb", "0") as (base, _):
        served, shadowed = [], []
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
            for row in rows:  # what version 2 answers to the same inputs, asked directly
                shadowed.append(client.post(f"{base}/v2/models/digits/versions/2/infer",
                                            json=infer_body([row.tolist()])).json()["outputs"][0]["data"])
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
