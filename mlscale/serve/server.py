"""Running the server: resolve and check the models first (bad URIs exit 2 before anything listens),
then uvicorn. SIGTERM turns readiness to 503 at once; uvicorn then stops accepting connections and lets
in-flight requests finish before the process exits."""

from __future__ import annotations

import logging
import sys

import uvicorn

from mlscale.registry import Registry
from mlscale.serve.app import ServerState, build_app
from mlscale.serve.cache import ResponseCache
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.models import ModelSlot, ServeOptions
from mlscale.serve.runtime import load_runtime


class _GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: object) -> None:
        self.state.ready = False  # load balancers stop sending; in-flight requests still finish
        super().handle_exit(sig, frame)


def build_state(uris: list[str], options: ServeOptions, registry_location: str | None,
                max_body_bytes: int) -> ServerState:
    registry = Registry(registry_location)
    for uri in uris:  # fail fast, before listening: unknown models, missing ONNX artifacts
        load_runtime(registry, registry.resolve(uri), options.runtime, options.threads)
    cache = ResponseCache(int(options.cache_mb * 1024 * 1024))
    metrics = ServerMetrics(cache)
    slots = [ModelSlot(uri, registry, options, metrics) for uri in uris]
    return ServerState(slots, metrics, cache, max_body_bytes)


def serve(uris: list[str], *, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions | None = None,
          registry_location: str | None = None, max_body_bytes: int = 8 * 1024 * 1024,
          log_level: str = "warning") -> None:
    state = build_state(uris, options or ServeOptions(), registry_location, max_body_bytes)
    logging.basicConfig(level=logging.WARNING, format="mlscale serve: %(message)s")
    # No proxy-header rewriting (nothing here reads the client address) and no Server/Date headers:
    # per-request work the hot path does not need.
    config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=30, lifespan="on", proxy_headers=False,
                            server_header=False, date_header=False)
    print(f"mlscale serve: {', '.join(uris)} on http://{host}:{port} (Open Inference Protocol v2, /predict, "
          "/metrics)", file=sys.stderr, flush=True)
    _GracefulServer(config, state).run()
