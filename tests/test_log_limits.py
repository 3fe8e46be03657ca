"""Warnings that a client's input causes are written once an interval, with a count of those held back."""

from __future__ import annotations

import logging

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mlscale.common.log_limits import limit_client_fed_logs


def test_an_over_long_traceparent_by_the_hundred_is_one_line_then_one_with_the_count(caplog):
    """OpenTelemetry's propagator warns once per request whose traceparent is over 512 characters."""
    limit = limit_client_fed_logs()
    propagator = TraceContextTextMapPropagator()
    with caplog.at_level(logging.WARNING):
        for _ in range(200):
            propagator.extract({"traceparent": "00-" + "a" * 600})
        assert len(caplog.records) == 1
        limit.interval_s = 0.0  # the interval over: the next line says how many were held back
        propagator.extract({"traceparent": "00-" + "a" * 600})
        limit.interval_s = 10.0
    assert len(caplog.records) == 2 and "(199 more like it" in caplog.records[1].getMessage()
