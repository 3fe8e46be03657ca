"""A served model as a Kubernetes Deployment behind a Service, made to lose no request.

- Probes on the Open Inference Protocol's health endpoints: readiness on ``/v2/health/ready`` (the
  model is loaded, the server is not draining), liveness on ``/v2/health/live`` (which fails when a
  model call has run past ``--exec-timeout-s``), a startup probe that gives loading time.
- Shutdown: when a pod is deleted, Kubernetes sends SIGTERM and removes it from the Service at the
  same time, and the removal takes a moment to reach every node. ``mlscale serve`` answers
  readiness 503 at once but goes on serving for ``--drain-delay-s``; then it stops listening and
  finishes the requests in flight, for at most 30 s. ``terminationGracePeriodSeconds`` covers all of
  that (drain delay + those 30 s + a margin), so the kubelet never has to SIGKILL a pod that is still
  answering. During the drain, answers carry ``Connection: close``, so clients on
  keep-alive connections reconnect to a pod that stays.
- A rolling update adds a new pod before it removes an old one (maxSurge 1, maxUnavailable 0), and a
  PodDisruptionBudget lets voluntary disruptions (node drains) take one pod at a time.
- A HorizontalPodAutoscaler between ``--replicas`` and ``--max-replicas``: on CPU by default, or on
  the pending requests that ``/metrics`` exports (through a custom metrics adapter, e.g. the
  Prometheus Adapter).
- The registry location comes from a Secret (``url``, and ``artifacts`` where the artifacts are not
  beside a file registry): a database password never appears in a manifest. The same holds for an online
  store with credentials (``--online-store-secret``: key ``url``, in the Secret-backed variable
  ``MLSCALE_ONLINE_STORE`` that ``mlscale serve`` reads when ``--online-store`` is not given, so it is
  in neither the manifest nor the server's command line); a flag
  after ``--`` whose value is a URL with credentials is refused, never written into the Deployment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from mlscale.common.redact import MASK, redact_text, redact_url, secrets_of
from mlscale.deploy.manifests import (
    Manifest,
    check_count,
    check_image,
    check_name,
    check_quantity,
    check_reference,
    check_seconds,
    labels,
    metadata,
    pod_security,
    resources,
    secret_env,
)
from mlscale.errors import UsageError

HTTP_PORT, GRPC_PORT = 8000, 8001
REGISTRY_DIR = "/mnt/registry"
PENDING_METRIC = "mlscale_inference_pending_request_count"
FINISH_IN_FLIGHT_S = 30  # mlscale serve's bound on finishing requests in flight once it stops listening
MARGIN_S = 5
MOST_DRAIN_S = 3600
# flags of `mlscale serve` the manifests set themselves (the probes, ports and grace period depend on them)
MANAGED_FLAGS = ("--host", "--port", "--grpc-port", "--no-grpc", "--drain-delay-s", "--exec-timeout-s",
                 "--registry")
ONLINE_STORE_ENV = "MLSCALE_ONLINE_STORE"


@dataclass(frozen=True)
class ServingDeployment:
    """What ``mlscale k8s serve`` renders."""

    name: str
    model_uri: str
    image: str
    replicas: int = 2
    max_replicas: int | None = None  # None: twice --replicas
    namespace: str | None = None
    grpc: bool = True
    drain_delay_s: float = 10.0
    exec_timeout_s: float = 30.0
    cpu: str = "1"
    memory: str = "1Gi"
    gpus: int = 0
    autoscale: Literal["cpu", "pending-requests"] = "cpu"
    target_cpu_percent: int = 70
    target_pending: int = 8
    registry_secret: str = "mlscale-registry"
    registry_claim: str | None = None
    online_store_secret: str | None = None  # a Secret whose key url is the online store (with its password)
    serve_args: tuple[str, ...] = ()  # more `mlscale serve` flags (batching, cache, SLO, online store...)

    def __post_init__(self) -> None:
        check_name("name", self.name)
        check_image(self.image)
        check_count("replicas", self.replicas)
        check_count("gpus", self.gpus, least=0)
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise UsageError(f"bad value max-replicas={self.max_replicas}: must be at least --replicas "
                             f"({self.replicas})")
        check_seconds("drain-delay-s", self.drain_delay_s, most=MOST_DRAIN_S)
        check_seconds("exec-timeout-s", self.exec_timeout_s, positive=True, most=MOST_DRAIN_S)
        if self.namespace is not None:
            check_name("namespace", self.namespace)
        check_reference("registry-secret", self.registry_secret)
        check_reference("registry-volume", self.registry_claim)
        check_reference("online-store-secret", self.online_store_secret)
        check_quantity("cpu", self.cpu, "cpu")
        check_quantity("memory", self.memory, "memory")
        for arg in self.serve_args:
            if arg.split("=", 1)[0] in MANAGED_FLAGS:
                raise UsageError(f"bad value {redact_text(arg)!r} after --: the manifests set {arg.split('=', 1)[0]} "
                                 "themselves (use the mlscale k8s serve flag of that name)")
        refuse_credentials(self.serve_args)
        if self.online_store_secret and any(a.split("=", 1)[0] == "--online-store" for a in self.serve_args):
            raise UsageError("bad value --online-store after --: --online-store-secret gives the online store already")
        check_count("target-cpu-percent", self.target_cpu_percent)
        check_count("target-pending", self.target_pending)
        check_workers(self.serve_args, self.cpu)
        check_kv_cache(self.serve_args, self.memory)

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else 2 * self.replicas

    @property
    def grace_period_s(self) -> int:
        """SIGTERM to exit, at most: the drain delay, then the server's bound on finishing what is in
        flight (a request still queued or computing past it is cut: the server, not the kubelet, says so)."""
        return math.ceil(self.drain_delay_s + FINISH_IN_FLIGHT_S + MARGIN_S)


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    return None


def check_workers(serve_args: tuple[str, ...], cpu: str) -> None:
    """``--workers`` after --: a number the pod's CPU request covers. ``auto`` is refused: the pods have
    no CPU limit (throttling would stall them), so it would count the node's cores, not the pod's."""
    workers = _flag_value(serve_args, "--workers")
    if workers is None:
        return
    if workers == "auto":
        raise UsageError("bad value --workers auto after --: the pods have no CPU limit, so auto would count the "
                         "node's cores; give --workers N and --cpu N")
    cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    if workers.isdigit() and int(workers) > max(1.0, cores):
        raise UsageError(f"bad value --workers {workers} after --: the pod requests {cpu} CPU; give --cpu {workers} "
                         "so that each worker has a core (and the autoscaler's CPU target means what it says)")


def check_kv_cache(serve_args: tuple[str, ...], memory: str) -> None:
    """``--kv-cache-mb`` after -- (a language model's KV pool, one per worker, allocated whole at start):
    every worker's pool under the pod's memory limit, or the pods would be OOM-killed as they start."""
    given, workers = _flag_value(serve_args, "--kv-cache-mb"), _flag_value(serve_args, "--workers") or "1"
    try:
        pools_mb = float(given) * int(workers) if given is not None else 0.0
    except ValueError:
        return  # the flags after -- are checked as mlscale serve checks them, elsewhere
    if pools_mb * 2**20 >= quantity_bytes(memory):
        raise UsageError(f"bad value --kv-cache-mb {given} after --: {workers} worker(s)' KV caches take {pools_mb:g} "
                         f"MiB, over the pod's memory limit {memory}; give --memory above it (the model and the "
                         "server need memory too)")


def _has_credentials(value: str) -> bool:
    """A URL whose password (or a credential query parameter) would be written out as it is."""
    return "://" in value and (bool(secrets_of(value)) or redact_url(value) != value)


def refuse_credentials(serve_args: tuple[str, ...]) -> None:
    """Flags after -- are written into the Deployment as they are: a URL with credentials among them would
    put its password into the manifest (and into `kubectl get -o yaml` for anyone who may read it)."""
    for index, arg in enumerate(serve_args):
        if arg.startswith("--") and "=" in arg:  # --flag=value
            flag, _, value = arg.partition("=")
        else:  # a value after its flag (or a flag: no URL)
            flag, value = (serve_args[index - 1] if index else ""), arg
        if not _has_credentials(value):
            continue
        where = f"{flag} " if flag.startswith("--") else ""
        hint = ("give it with --online-store-secret SECRET instead, from a Secret created with `kubectl create "
                "secret generic SECRET --from-literal=url=URL` (the pods read it from the Secret)"
                if flag == "--online-store" else "put no credentials in flags after --; a Secret holds them")
        raise UsageError(f"bad value {where}{redact_url(value)!r} after --: a URL with credentials would be written "
                         f"into the Deployment ({MASK} stands for them here); {hint}")


def serving_manifests(spec: ServingDeployment) -> list[Manifest]:
    """Deployment, Service, PodDisruptionBudget and (unless the replica count is fixed) the autoscaler."""
    out = [_deployment(spec), _service(spec), _disruption_budget(spec)]
    if spec.most_replicas > spec.replicas:
        out.append(_autoscaler(spec))
    return out


def serve_command(spec: ServingDeployment) -> list[str]:
    command = ["mlscale", "serve", spec.model_uri, "--host", "0.0.0.0", "--port", str(HTTP_PORT),
               "--drain-delay-s", f"{spec.drain_delay_s:g}", "--exec-timeout-s", f"{spec.exec_timeout_s:g}"]
    command += ["--grpc-port", str(GRPC_PORT)] if spec.grpc else ["--no-grpc"]
    given = {arg.split("=", 1)[0] for arg in spec.serve_args}
    for flag, value in client_limits(spec.memory, _given_max_body_mb(spec.serve_args)).items():
        if flag not in given:
            command += [flag, value]
    return command + list(spec.serve_args)


def _given_max_body_mb(serve_args: tuple[str, ...]) -> float:
    """``--max-body-mb`` among the flags after --, else the server's default (8)."""
    for index, arg in enumerate(serve_args):
        flag, _, value = arg.partition("=")
        if flag == "--max-body-mb":
            value = value or (serve_args[index + 1] if index + 1 < len(serve_args) else "")
            try:
                return float(value)
            except ValueError:
                break  # the flags after -- are checked as mlscale serve checks them, elsewhere
    return 8.0


def client_limits(memory: str | None, max_body_mb: float = 8.0) -> dict[str, str]:
    """What clients may hold, in line with the pod's memory limit, so that no number of slow or flooding
    clients can get it OOM-killed: a sixteenth of the limit for request bodies held at once (never less
    than one body of the largest size), and another for connections (each may buffer 64 KiB before the
    server stops reading it)."""
    if memory is None:
        return {}
    budget = quantity_bytes(memory) / 16
    body_mb = max(max_body_mb, budget / 2**20)
    connections = int(min(4096, max(64, budget // 2**16)))
    return {"--max-inflight-mb": f"{body_mb:g}", "--max-connections": str(connections)}


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(quantity: str) -> float:
    """A memory quantity as Kubernetes writes it (``1Gi``, ``512Mi``, ``1.5G``) in bytes."""
    number = quantity.rstrip("kMGTPEi")
    return float(number) * _UNITS[quantity[len(number):]]


def _probe(path: str, period_s: int, failures: int, timeout_s: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "timeoutSeconds": timeout_s,
            "failureThreshold": failures}


def _container(spec: ServingDeployment) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": HTTP_PORT}]
    if spec.grpc:
        ports.append({"name": "grpc", "containerPort": GRPC_PORT})
    env = [secret_env("MLSCALE_REGISTRY", spec.registry_secret, "url"),
           secret_env("MLSCALE_ARTIFACTS", spec.registry_secret, "artifacts", optional=True),
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if spec.online_store_secret:
        env.append(secret_env(ONLINE_STORE_ENV, spec.online_store_secret, "url"))
    container: dict[str, Any] = {
        "name": "server", "image": spec.image, "command": serve_command(spec), "env": env, "ports": ports,
        "startupProbe": _probe("/v2/health/live", period_s=2, failures=60, timeout_s=2),  # 2 minutes to start
        # two misses take a pod out: a deleted pod leaves the Service's endpoints without a probe, so
        # one slow answer under load need not
        "readinessProbe": _probe("/v2/health/ready", period_s=2, failures=2, timeout_s=2),
        "livenessProbe": _probe("/v2/health/live", period_s=10, failures=3, timeout_s=5),
        "resources": resources(spec.cpu, spec.memory, spec.gpus),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if spec.registry_claim:
        container["volumeMounts"] = [{"name": "registry", "mountPath": REGISTRY_DIR}]
    return container


def _deployment(spec: ServingDeployment) -> Manifest:
    pod_labels = labels(spec.name, "serving")
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.grace_period_s,
        "securityContext": pod_security(),
        "containers": [_container(spec)],
        # replicas on different nodes where the cluster allows: one node lost is not the whole service
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": pod_labels}}],
    }
    if spec.registry_claim:
        pod["volumes"] = [{"name": "registry", "persistentVolumeClaim": {"claimName": spec.registry_claim}}]
    deployment_spec: dict[str, Any] = {}
    if spec.most_replicas == spec.replicas:  # with an autoscaler, it owns the count (no fight on apply)
        deployment_spec["replicas"] = spec.replicas
    deployment_spec.update({
        "selector": {"matchLabels": pod_labels},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": pod_labels}, "spec": pod},
    })
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(spec.name, spec.namespace, "serving"),
            "spec": deployment_spec}


def _service(spec: ServingDeployment) -> Manifest:
    ports: list[dict[str, Any]] = [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
    if spec.grpc:  # plaintext HTTP/2: what gRPC-aware proxies and meshes look for
        ports.append({"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                      "appProtocol": "kubernetes.io/h2c"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec.name, spec.namespace, "serving"),
            "spec": {"type": "ClusterIP", "selector": labels(spec.name, "serving"), "ports": ports}}


def _disruption_budget(spec: ServingDeployment) -> Manifest:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(spec.name, spec.namespace, "serving"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(spec.name, "serving")}}}


def _autoscaler(spec: ServingDeployment) -> Manifest:
    if spec.autoscale == "cpu":
        metric: dict[str, Any] = {"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": spec.target_cpu_percent}}}
    else:  # requests waiting in a pod's queue, from /metrics through a custom metrics adapter
        target = {"type": "AverageValue", "averageValue": str(spec.target_pending)}
        metric = {"type": "Pods", "pods": {"metric": {"name": PENDING_METRIC}, "target": target}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(spec.name, spec.namespace, "serving"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
                     "minReplicas": spec.replicas, "maxReplicas": spec.most_replicas, "metrics": [metric]}}
