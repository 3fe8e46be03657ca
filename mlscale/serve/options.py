"""The server's options: one validated model for the CLI and the Python API alike.

``ServeOptions(max_batch_size=0)`` raises, as ``mlscale serve --max-batch-size 0`` exits 2: a value
the server cannot work with is refused before any model is loaded.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlscale.common.connections import open_file_connection_limit
from mlscale.errors import UsageError, describe_validation_error
from mlscale.serve.runtimes import AUTO, RuntimeChoice


class ServeOptions(BaseModel):
    """How ``mlscale serve`` listens, batches, caches, refuses and shuts down."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on; 0.0.0.0 for every interface")
    port: int = Field(8000, ge=1, le=65535)
    grpc_port: int | None = Field(8001, ge=1, le=65535, description="port of the Open Inference Protocol's "
                                  "gRPC service (--no-grpc, or None in Python: none)")
    max_batch_size: int = Field(64, ge=1, description="most rows per model call")
    max_delay_ms: float = Field(2.0, ge=0, description="longest a queued request waits for batch-mates")
    queue_limit: int = Field(256, ge=1, description="queued requests per model before 503")
    slo_ms: float | None = Field(None, gt=0, description="latency objective: adapts the batch size, refuses "
                                 "requests that would miss it")
    timeout_ms: float = Field(10_000, gt=0, description="longest a request may wait in the queue (then 504)")
    runtime: RuntimeChoice = AUTO  # one of runtimes.RUNTIME_CHOICES
    online_store: str | None = Field(None, description="where a model trained from features finds them: a "
                                     "SQLite file or a redis:// URL (requests then name entities)")
    feature_log: str | None = Field(None, description="a SQLite file the served feature vectors are written to, "
                                    "for `mlscale features skew`")
    precision: Literal["as-trained", "fp16", "bf16"] = Field(
        "as-trained", description="the datatype the model computes in and its inputs and outputs have: as "
        "trained, or FP16 / BF16 (weights cast at load; the torch runtime)")
    threads: int = Field(1, ge=1, description="threads per model execution")
    workers: int | Literal["auto"] = Field(1, description="server processes sharing the HTTP and gRPC ports, "
                                           "each with its own copy of the models and batchers; auto: the cores "
                                           "this process may use (CPU affinity and cgroup quota)")
    instances: int = Field(1, ge=1, description="model executions a worker runs in parallel on its one copy "
                           "of the weights (as Triton's instance groups); pays where a runtime releases the GIL "
                           "and cores or a GPU are left over")
    worker_start_timeout_s: float = Field(300.0, gt=0, description="with --workers N: a worker not ready this "
                                          "long after it was started is stopped (SIGTERM, then SIGKILL) and the "
                                          "reason logged; at the server's start that stops the server, later "
                                          "the worker is restarted")
    canary: str | None = Field(None, description="URI=PERCENT: a second version of the first model that takes "
                               "this share of its requests by name (sticky per --route-header or entity key); "
                               "the share follows the registry tag mlscale.canary_percent (mlscale models canary)")
    shadow: str | None = Field(None, description="URI[=PERCENT]: a version that also answers a copy of every "
                               "request (or of this share) off the response path, compared with the served "
                               "answer, never returned")
    expose_rollout_versions: bool = Field(False, description="let a request that names the version of the "
                                          "--canary or the --shadow (/v2/models/NAME/versions/V/infer, gRPC "
                                          "model_version) be answered by it; without this flag it gets 403, so "
                                          "that a canary answers only its share of the requests by name and a "
                                          "shadow's answers are never returned")
    shadow_queue: int = Field(16, ge=1, description="copies the shadow may hold queued; past it copies are "
                              "dropped (counted), so the served path never waits for the shadow")
    route_header: str = Field("x-route-key", description="request header whose value picks the version in a "
                              "traffic split (the same value, the same version); without it, entity keys, else "
                              "an even split")
    # Not a flag (a secret stays off command lines): $MLSCALE_ROUTE_SECRET, else random. One value per
    # server: the supervisor's options, handed whole to each worker, carry it, so a key is sticky across
    # the workers; a restart draws another unless the environment gives it.
    route_secret: str = Field(default_factory=lambda: secrets.token_hex(16), min_length=16, repr=False,
                              description="the secret key of the route-key hash, so that no client can pick "
                              "keys that land on the canary")
    otlp_endpoint: str | None = Field(None, description="OpenTelemetry collector (OTLP/HTTP, e.g. "
                                      "http://127.0.0.1:4318) to export request traces to; default "
                                      "$OTEL_EXPORTER_OTLP_ENDPOINT; needs mlscale[tracing]")
    cache_mb: float = Field(64.0, ge=0, description="response cache size; 0 turns it off")
    reload_interval_s: float = Field(2.0, gt=0, description="how often aliases and stages are checked")
    max_body_mb: float = Field(8.0, gt=0, description="larger request bodies get 413")
    drain_delay_s: float = Field(0.0, ge=0, description="after SIGTERM: seconds of readiness 503 while "
                                 "inference is still served, before the listener closes")
    exec_timeout_s: float | None = Field(None, gt=0, description="a model call running longer marks the "
                                         "server not live (liveness 503), so an orchestrator restarts it")
    # What a hostile or broken client may hold: connections, time, bytes. A request takes an admission
    # slot only once its whole body has arrived, so slow senders cost a connection, never a slot.
    read_timeout_s: float = Field(10.0, gt=0, description="longest a request body may take to arrive after "
                                  "its headers (then 408 and the connection is closed)")
    header_timeout_s: float = Field(5.0, gt=0, description="longest a connection may take to send a request's "
                                    "headers, the first ones included (then it is closed)")
    keep_alive_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    max_connections: int | None = Field(None, ge=1, description="open HTTP connections (and gRPC calls) "
                                        "before new requests get 503; default: sized for the host's open-file "
                                        "limit, at most 2048")
    max_inflight_mb: float = Field(64.0, gt=0, description="request-body bytes the server holds at once, "
                                   "across requests; past it new bodies get 503 at once")
    # A causal language model's generation engine (/v1/completions, /v2/models/NAME/generate); its
    # waiting queue is --queue-limit.
    kv_cache_mb: float = Field(64.0, gt=0, description="a language model's KV cache: one pool of blocks, which "
                               "bounds the tokens its running sequences hold")
    kv_block_size: int = Field(16, ge=1, description="tokens per KV-cache block (the unit of the pool and of "
                               "prefix caching)")
    max_batch_tokens: int = Field(256, ge=1, description="tokens a generation step computes at most (prompts' "
                                  "prefill and every running sequence's next token)")
    max_sequences: int = Field(64, ge=1, description="sequences a language model generates at once")
    no_prefix_caching: bool = Field(False, description="recompute every prompt (no reuse of a cached prefix's "
                                    "KV blocks)")
    no_chunked_prefill: bool = Field(False, description="prefill a prompt in one step, however long")
    store_timeout_ms: float = Field(500.0, gt=0, description="longest an online-store lookup may take (then "
                                    "503 with Retry-After for the requests that need it)")

    @model_validator(mode="after")
    def _ports_differ(self) -> ServeOptions:
        if self.grpc_port == self.port:
            raise ValueError(f"grpc-port {self.grpc_port} is the HTTP port: give each its own")
        if self.max_inflight_mb < self.max_body_mb:
            raise ValueError(f"max-inflight-mb {self.max_inflight_mb:g} is below max-body-mb {self.max_body_mb:g}: "
                             "no body of the largest size could ever be read")
        if isinstance(self.workers, int) and self.workers < 1:
            raise ValueError(f"workers {self.workers} must be at least 1 (or auto)")
        for name in ("canary", "shadow"):
            value = getattr(self, name)
            if value is not None:
                split_share(value, name, required=name == "canary")
        return self

    @property
    def worker_count(self) -> int:
        """``workers`` as a number (``auto``: the cores this process may use)."""
        return usable_cores() if self.workers == "auto" else self.workers

    @property
    def core_per_worker(self) -> bool:
        """Several workers, as many as the cores or more: each has about a core of its own, so its small
        batches run on its event loop as on a one-core host (``DynamicBatcher``'s ``one_core``)."""
        count = self.worker_count
        return count > 1 and count >= usable_cores()

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_inflight_bytes(self) -> int:
        return int(self.max_inflight_mb * 1024 * 1024)

    @property
    def connection_limit(self) -> int:
        """``max_connections``, or what the process's open-file limit allows (a socket is a file; leave
        room for models, logs and the registry), at most 2048."""
        return self.max_connections if self.max_connections is not None else open_file_connection_limit(2048)


def split_share(value: str, name: str, required: bool) -> tuple[str, float]:
    """``URI=PERCENT`` (``URI`` alone when not ``required``: 100) as (URI, percent in [0, 100])."""
    uri, sep, percent = value.rpartition("=")
    if not sep:
        if required:
            raise ValueError(f"{name} {value!r} must be URI=PERCENT, e.g. models:/digits@challenger=10")
        return value, 100.0
    try:
        share = float(percent)
    except ValueError:
        raise ValueError(f"{name} {value!r}: {percent!r} is not a percentage") from None
    if not 0 <= share <= 100:
        raise ValueError(f"{name} {value!r}: the share must be between 0 and 100")
    return uri, share


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, bounded by a cgroup v2 (or v1) CPU quota,
    as a container's limit sets it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = None
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if limit != "max":
            quota = int(limit) / int(period)
    except (OSError, ValueError):
        try:
            limit = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
            if limit > 0:
                quota = limit / int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            pass
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def serve_options(**values: Any) -> ServeOptions:
    """``ServeOptions`` from keyword values (``None`` means the default); a bad value is a one-line
    ``UsageError`` naming it in the CLI's spelling."""
    try:
        return ServeOptions(**{key: value for key, value in values.items() if value is not None})
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None
