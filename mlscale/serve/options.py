"""The server's options: one validated model for the CLI and the Python API alike.

``ServeOptions(max_batch_size=0)`` raises, as ``mlscale serve --max-batch-size 0`` exits 2: a value
the server cannot work with is refused before any model is loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlscale.errors import UsageError
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
    store_timeout_ms: float = Field(500.0, gt=0, description="longest an online-store lookup may take (then "
                                    "503 with Retry-After for the requests that need it)")

    @model_validator(mode="after")
    def _ports_differ(self) -> ServeOptions:
        if self.grpc_port == self.port:
            raise ValueError(f"grpc-port {self.grpc_port} is the HTTP port: give each its own")
        if self.max_inflight_mb < self.max_body_mb:
            raise ValueError(f"max-inflight-mb {self.max_inflight_mb:g} is below max-body-mb {self.max_body_mb:g}: "
                             "no body of the largest size could ever be read")
        return self

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
        if self.max_connections is not None:
            return self.max_connections
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(64, min(2048, (soft if soft != resource.RLIM_INFINITY else 4096) - 128))


def serve_options(**values: Any) -> ServeOptions:
    """``ServeOptions`` from keyword values (``None`` means the default); a bad value is a one-line
    ``UsageError`` naming it in the CLI's spelling."""
    from mlscale.errors import describe_validation_error

    try:
        return ServeOptions(**{key: value for key, value in values.items() if value is not None})
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None
