"""The rendered serving Deployment, run locally: a rolling update under steady load loses no request.

Two replicas of the Deployment's container (its exact command, the registry location from the
Secret, each a pod of tests/deploy/pods.py) run behind a stand-in for the Service
(tests/deploy/service_proxy.py: connections round robin, a replica in rotation while its readiness
probe passes, probed at the manifest's period). Open-loop load runs through it while both replicas
are replaced the way the Deployment's strategy does it (maxSurge 1, maxUnavailable 0): a new pod
starts, and once it is ready an old one gets SIGTERM. Only the ports differ from the manifest: the
local pods share one network, where each pod in a cluster has its own address.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mlscale import TrainConfig, fit
from mlscale.deploy import render_serving, serving_manifests
from mlscale.registry import Registry, register_run
from tests.deploy.pods import Pod, by_kind, hosts_file, require_namespaces
from tests.deploy.service_proxy import ServiceProxy
from tests.serve.conftest import free_port, infer_body

DRAIN_DELAY_S = 6.0  # more than the readiness probe's period x failures (2 s x 2): the proxy sees the 503s in time
LOAD_RATE, LOAD_S = 100, 16.0  # at least LOAD_S; longer where pods take longer to become ready (below)


@pytest.fixture(scope="module")
def registry_location(tmp_path_factory):
    root = tmp_path_factory.mktemp("rolling")
    location = str(root / "registry")
    fit(TrainConfig(task="digits", steps=20, run_dir=str(root / "run"), progress=False))
    registry = Registry(location)
    version = register_run(registry, root / "run", "digits")
    registry.set_alias("digits", version.version, "production")
    return location


def _with_ports(command: list[str], http: int, grpc: int) -> list[str]:
    out = list(command)
    for flag, port in (("--port", http), ("--grpc-port", grpc)):
        out[out.index(flag) + 1] = str(port)
    return out


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_a_rolling_update_under_load_loses_no_request(registry_location, tmp_path):
    require_namespaces()
    spec, _ = render_serving(uri="models:/digits@production", image="mlscale:test", replicas=2,
                             drain_delay_s=DRAIN_DELAY_S, registry=registry_location)
    manifests = serving_manifests(spec)
    deployment = by_kind(manifests, "Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    probe = container["readinessProbe"]
    assert probe["httpGet"]["path"] == "/v2/health/ready"
    secrets = {spec.registry_secret: {"url": registry_location}}  # what `kubectl create secret` would hold
    hosts = hosts_file(tmp_path / "hosts", [], "none")
    started: list[tuple[Pod, int]] = []

    def new_pod(proxy: ServiceProxy) -> Pod:
        pod = Pod(template, f"{spec.name}-{len(started)}", tmp_path, {}, hosts, secrets=secrets)
        port = free_port()
        pod.start("server", _with_ports(container["command"], port, free_port()))
        started.append((pod, port))
        proxy.add(pod.name, port)
        _wait(lambda: pod.name in proxy.in_rotation(), 90, f"{pod.name} never became ready: {pod.log.read_text()}")
        return pod

    assert probe["periodSeconds"] * probe["failureThreshold"] < DRAIN_DELAY_S
    with ServiceProxy(probe["httpGet"]["path"], probe["periodSeconds"], probe["timeoutSeconds"],
                      probe["failureThreshold"]) as proxy:
        try:
            began = time.monotonic()
            old = [new_pod(proxy), new_pod(proxy)]
            ready_s = (time.monotonic() - began) / 2  # what a pod takes to become ready on this host, now
            # The load outlasts the update on any host: two new pods made ready (slower under the load), the
            # last old pod's drain, and then time for the new pods to take over its connections.
            load_s = max(LOAD_S, 2.0 + 2 * 1.5 * ready_s + DRAIN_DELAY_S + 4.0)
            body = json.dumps(infer_body([[0.5] * 64]))
            config = {"host": "127.0.0.1", "port": proxy.port, "path": "/v2/models/digits/infer", "bodies": [body],
                      "rate": LOAD_RATE, "duration_s": load_s, "warmup_s": 0.0, "connections": 8, "timeout_s": 30}
            load = subprocess.Popen([sys.executable, "-m", "mlscale.bench.loadgen", json.dumps(config)],
                                    stdout=subprocess.PIPE, text=True)
            time.sleep(2.0)
            for pod in old:  # the Deployment's order: a new pod ready first, then an old one terminated
                new_pod(proxy)
                pod.terminate()
            for pod in old:  # each exits 0 within the grace period, after its drain
                assert pod.process.wait(timeout=template["spec"]["terminationGracePeriodSeconds"]) == 0
            output, _ = load.communicate(timeout=load_s + 60)
        finally:
            for pod, _ in started:
                pod.kill()
    result = json.loads(output)
    print(f"rolling update: {result['requests']} requests in {load_s:.0f} s, statuses {result['statuses']}, "
          f"connections per pod {dict(proxy.connections)}, p99 {result['latency_ms']['p99']:.1f} ms")
    assert result["requests"] > 0.8 * LOAD_RATE * load_s
    assert result["statuses"] == {"200": result["requests"]}, result["statuses"]  # 0 errors
    assert proxy.refused == 0
    new_names = [pod.name for pod, _ in started[2:]]
    assert all(proxy.connections[name] > 0 for name in new_names), proxy.connections  # the new pods served
