"""The server's options: one validated model for the CLI and the Python API alike.

``ServeOptions(max_batch_size=0)`` raises, as ``mlscale serve --max-batch-size 0`` exits 2: a value
the server cannot work with is refused before any model is loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlscale.errors import UsageError


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
    runtime: Literal["auto", "onnx", "torch"] = "auto"
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

    @model_validator(mode="after")
    def _ports_differ(self) -> ServeOptions:
        if self.grpc_port == self.port:
            raise ValueError(f"grpc-port {self.grpc_port} is the HTTP port: give each its own")
        return self

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)


def serve_options(**values: Any) -> ServeOptions:
    """``ServeOptions`` from keyword values (``None`` means the default); a bad value is a one-line
    ``UsageError`` naming it in the CLI's spelling."""
    from mlscale.config import describe_error

    try:
        return ServeOptions(**{key: value for key, value in values.items() if value is not None})
    except ValidationError as exc:
        raise UsageError(describe_error(exc, {})) from None
