"""Request traces over OTLP/HTTP: a real receiver in the test parses the exported spans with the
protocol's own messages; the caller's traceparent is continued (HTTP and gRPC) and returned, every
step of a request is a child of its server span, and requests that shared a batch name one batch."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.declared_tasks import SLOW
from tests.serve.conftest import infer_body, metric, running_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                message = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for resource in message.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def wait_for(self, check, timeout: float = 15.0) -> list:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                spans = list(self.spans)
            if check(spans):
                return spans
            time.sleep(0.1)
        raise AssertionError(f"spans never arrived: {[s.name for s in spans]}")


def test_request_spans_continue_the_callers_trace_and_link_the_requests_of_a_batch(serve_registry, monkeypatch):
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms, not every 5 s
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    try:
        with running_server(serve_registry, "models:/misbehaving/1", "models:/digits/1", "--otlp-endpoint", endpoint,
                            "--cache-mb", "0", "--max-delay-ms", "50") as (base, server):
            parent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
            answer = httpx.post(f"{base}/v2/models/digits/infer", json=infer_body([[0.5] * 64]),
                                headers={"traceparent": parent})
            assert answer.status_code == 200
            returned = answer.headers["traceparent"].split("-")
            assert returned[1] == TRACE_ID and returned[2] != CALLER_SPAN  # the server's span, in the same trace

            # requests that queue while the model is held by a slow call (2 s) leave in one batch
            def infer(first: float) -> int:
                body = infer_body([[first, 0.5, 0.5, 0.5]])
                return httpx.post(f"{base}/v2/models/misbehaving/infer", timeout=30, json=body).status_code

            with ThreadPoolExecutor(9) as pool:
                held = pool.submit(infer, SLOW)
                deadline = time.time() + 10
                while metric(base, "mlscale_inference_executing", model="misbehaving", version="1") != 1:
                    assert time.time() < deadline, "the slow call never started"
                    time.sleep(0.02)
                codes = list(pool.map(infer, [i / 8 for i in range(8)]))
            assert codes == [200] * 8 and held.result() == 200

            import tritonclient.grpc as grpcclient

            client = grpcclient.InferenceServerClient(server.grpc_address)
            tensor = grpcclient.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(np.full((1, 64), 0.25, np.float32))
            grpc_parent = f"00-{TRACE_ID[::-1]}-{CALLER_SPAN}-01"
            client.infer("digits", [tensor], headers={"traceparent": grpc_parent})
            client.close()

            spans = receiver.wait_for(lambda spans: sum(s.name == "infer misbehaving" for s in spans) == 9
                                      and sum(s.name == "infer digits" for s in spans) == 2)
    finally:
        receiver.shutdown()

    by_id = {span.span_id: span for span in spans}
    http_root = next(s for s in spans if s.name == "infer digits" and s.trace_id.hex() == TRACE_ID)
    assert http_root.parent_span_id.hex() == CALLER_SPAN and http_root.kind == http_root.SPAN_KIND_SERVER
    assert http_root.span_id.hex() == returned[2]
    children = {s.name: s for s in spans if s.parent_span_id == http_root.span_id}
    assert set(children) >= {"admission", "queue", "batch", "execute"}, set(children)
    for child in children.values():  # within the request's span
        assert http_root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= http_root.end_time_unix_nano
    execute, batch = children["execute"], children["batch"]
    assert batch.start_time_unix_nano <= execute.start_time_unix_nano
    grpc_root = next(s for s in spans if s.name == "infer digits" and s.trace_id.hex() == TRACE_ID[::-1])
    assert grpc_root.parent_span_id.hex() == CALLER_SPAN

    # the misbehaving model's requests: each a trace of its own; the ones that shared a batch name the
    # same batch id, and that batch's span links to each of them
    slow = [s for s in spans if s.name == "infer misbehaving"]
    assert len({s.trace_id for s in slow}) == 9
    batch_of = {}
    for root in slow:
        (mine,) = [s for s in spans if s.parent_span_id == root.span_id and s.name == "batch"]
        attributes = {a.key: a.value.int_value for a in mine.attributes}
        batch_of[root.span_id] = attributes["mlscale.batch.id"]
        assert attributes["mlscale.batch.requests"] >= 1
    shared = [span_id for span_id, batch_id in batch_of.items()
              if list(batch_of.values()).count(batch_id) > 1]
    assert shared, "no two concurrent requests shared a batch"
    batch_spans = [s for s in spans if s.name == "batch" and not s.parent_span_id]
    for span_id in shared:
        linking = [b for b in batch_spans if any(link.span_id == span_id for link in b.links)]
        assert len(linking) == 1 and len(linking[0].links) > 1
    assert all(s.span_id in by_id for s in slow)
