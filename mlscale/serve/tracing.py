"""Request traces, exported over OTLP/HTTP with the OpenTelemetry SDK (``pip install mlscale[tracing]``)
when ``--otlp-endpoint`` (or ``$OTEL_EXPORTER_OTLP_ENDPOINT``) is set.

A request's span (``infer MODEL``, kind SERVER) continues the caller's trace when it sends a W3C
``traceparent`` (HTTP header or gRPC metadata), and the response carries the server span's own
``traceparent``. Its children: ``admission`` (from arrival to the admission decision, the body's
arrival included), ``features`` (the online-store lookup), ``cache`` (hit, miss or coalesced),
``queue`` (waiting for a batch), ``batch`` (from the batch's dispatch to its end: ``mlscale.batch.id``,
rows and requests) and ``execute`` (the model call). Each batch also has a span of its own, linked to
the span of every request it carried: the fan-in of a dynamic batch, as OpenTelemetry models it.
A generation request's span (``generate MODEL``) has, for each choice, ``queue`` (from its arrival at the
engine to the step that first computed it), ``prefill`` (to its first token) and ``decode`` (to its last);
a stream's span ends with the stream.

Off (the default), the SDK is never imported and a request pays a context-variable read or two. On,
times are taken on the request's path (perf_counter), the spans are made from them once the answer
is computed, and the SDK's batch processor exports them from a thread of its own.
"""

from __future__ import annotations

import contextvars
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from mlscale.errors import UsageError

# The trace of the request the running task serves (None: tracing off, or no request). Set by the
# transports, read by the batcher and the cache: no parameter threads it through every call.
current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("mlscale_request_trace", default=None)


@dataclass
class RequestTrace:
    """What one request's spans are made of: perf_counter times, filled in along its path."""

    model: str
    protocol: str
    parent: Any  # the caller's context (from traceparent), or None
    start: float
    span: Any = None  # the server span, started at ``start``
    admitted: float | None = None
    enqueued: float | None = None
    dispatched: float | None = None
    exec_start: float | None = None
    exec_end: float | None = None
    batch: dict[str, int] = field(default_factory=dict)  # id, rows, requests
    version: str | None = None  # the version that answered
    marks: list[tuple[str, float, float, dict[str, Any]]] = field(default_factory=list)  # other children
    ended: bool = False  # its spans made (``Tracer.finish``): once only

    def mark(self, name: str, start: float, end: float, **attributes: Any) -> None:
        self.marks.append((name, start, end, attributes))


class Tracer:
    """The server's tracer: OTLP/HTTP export of request and batch spans."""

    def __init__(self, endpoint: str, worker: str | None = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise UsageError("--otlp-endpoint needs the OpenTelemetry SDK: pip install 'mlscale[tracing]'") from None
        attributes = {"service.name": "mlscale-serve", **({"mlscale.worker": worker} if worker else {})}
        self.provider = TracerProvider(resource=Resource.create(attributes))
        url = endpoint.rstrip("/")
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=url if url.endswith("/v1/traces") else f"{url}/v1/traces")))
        self.tracer = self.provider.get_tracer("mlscale.serve")
        self._trace, self.propagator = trace, TraceContextTextMapPropagator()
        self._offset_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> epoch nanoseconds
        self._batch_ids = itertools.count(1)

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def begin(self, model: str, protocol: str, traceparent: str | None, start: float,
              operation: str = "infer") -> RequestTrace:
        """A request's trace, its server span (``OPERATION MODEL``) started at ``start``, continuing
        ``traceparent``'s trace."""
        parent = self.propagator.extract({"traceparent": traceparent}) if traceparent else None
        request = RequestTrace(model, protocol, parent, start)
        request.span = self.tracer.start_span(f"{operation} {model}", context=parent, start_time=self._ns(start),
                                              kind=self._trace.SpanKind.SERVER,
                                              attributes={"rpc.system": protocol, "mlscale.model": model})
        return request

    def traceparent(self, request: RequestTrace) -> str:
        """The ``traceparent`` that names the server span: what the response carries."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._trace.set_span_in_context(request.span))
        return carrier["traceparent"]

    def new_batch_id(self) -> int:
        return next(self._batch_ids)

    def batch(self, requests: list[RequestTrace], info: dict[str, int], start: float, end: float) -> None:
        """The span of one batch, linked to every traced request it carried."""
        links = [self._trace.Link(r.span.get_span_context()) for r in requests]
        span = self.tracer.start_span("batch", start_time=self._ns(start), links=links,
                                      attributes={f"mlscale.batch.{key}": value for key, value in info.items()})
        span.end(end_time=self._ns(end))

    def finish(self, request: RequestTrace, status: int) -> None:
        """The request's child spans, from the times its path recorded, then its own end (a trace ended
        already is left as it is)."""
        if request.ended:
            return
        request.ended = True
        parent = self._trace.set_span_in_context(request.span)

        def child(name: str, start: float | None, end: float | None, **attributes: Any) -> None:
            if start is not None and end is not None:
                span = self.tracer.start_span(name, context=parent, start_time=self._ns(start), attributes=attributes)
                span.end(end_time=self._ns(end))

        child("admission", request.start, request.admitted)
        for name, start, end, attributes in request.marks:
            child(name, start, end, **attributes)
        child("queue", request.enqueued, request.dispatched)
        child("batch", request.dispatched, request.exec_end,
              **{f"mlscale.batch.{key}": value for key, value in request.batch.items()})
        child("execute", request.exec_start, request.exec_end)
        span = request.span
        span.set_attribute("http.response.status_code", status)
        if request.version is not None:
            span.set_attribute("mlscale.version", request.version)
        if status >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        span.end(end_time=self._ns(time.perf_counter()))

    def shutdown(self) -> None:
        """Export what is left (at the server's stop)."""
        self.provider.shutdown()
