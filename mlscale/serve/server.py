"""Running the server: resolve, load and verify every model first (a bad URI exits 2 before anything
listens), then uvicorn.

Shutdown is made for a load balancer: on SIGTERM readiness answers 503 at once, while inference is
still served for ``drain_delay_s`` (the time a Kubernetes Service or a load balancer needs to see the
503 and stop routing here); then the listener closes, requests in flight finish and the process exits
0. A second signal exits at once."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from mlscale.common.connections import protocol_with
from mlscale.common.log_limits import limit_client_fed_logs
from mlscale.errors import MlscaleError, UsageError
from mlscale.registry import Registry, parse_uri
from mlscale.serve.cache import ResponseCache
from mlscale.serve.core import GRPC_GRACE_S, GrpcStarter, ServerState
from mlscale.serve.http import build_app
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.models import ModelSlot
from mlscale.serve.options import ServeOptions, split_share
from mlscale.serve.peers import Peers
from mlscale.serve.rollout import Shadow, TrafficSplit, route_hash_key
from mlscale.serve.runtimes import load_runtime
from mlscale.serve.tracing import Tracer

log = logging.getLogger("mlscale.serve")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_delay_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_delay_s = state, drain_delay_s
        self.drain_ends: float | None = None
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit or self.drain_ends is not None:  # a second signal: exit now
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True  # readiness 503 from now on, also if start-up is still going
        self.state.ready = False  # load balancers stop sending; inference is still served
        if sig == signal.SIGTERM and self.drain_delay_s > 0:
            self.drain_ends = time.monotonic() + self.drain_delay_s
        else:
            self.should_exit = True
        # Not re-raised once shut down (uvicorn's default): a drained exit is a clean exit, status 0.

    async def on_tick(self, counter: int) -> bool:
        if self.drain_ends is not None and not self._announced:  # logged here, not in the signal handler
            self._announced = True
            log.warning("SIGTERM: readiness 503, inference served for %g s more", self.drain_delay_s)
        if self.drain_ends is not None and not self.should_exit and time.monotonic() >= self.drain_ends:
            log.warning("drain delay over: closing the listener, finishing requests in flight")
            self.should_exit = True
        if self.should_exit and self.state.grpc_server is not None:  # gRPC closes with HTTP, in the loop
            self.state.stop_grpc(0 if self.force_exit else GRPC_GRACE_S)
        return await super().on_tick(counter)


async def _start_grpc(state: ServerState, *args: Any, **kwargs: Any) -> Any:
    """The gRPC service's start: grpcio is imported only when the service is on, once the models are in."""
    from mlscale.serve.grpc import start_grpc

    return await start_grpc(state, *args, **kwargs)


def model_uris(uris: list[str], options: ServeOptions) -> list[str]:
    """Every version the server loads: the URIs served, then the canary's and the shadow's."""
    extra = [split_share(value, name, required=name == "canary")[0]
             for name, value in (("canary", options.canary), ("shadow", options.shadow)) if value is not None]
    return [*uris, *extra]


def build_state(uris: list[str], options: ServeOptions, registry: Registry, *, peers: Peers | None = None,
                start_grpc: GrpcStarter | None = None) -> ServerState:
    """Every URI resolved and its runtime loaded (artifacts read and hashed) once, before listening; the
    state built whole from them. The response cache's bound is the whole server's: each of several
    workers has its share. ``peers``: the other workers of a server of several; ``start_grpc``: the gRPC
    service's start, when it is to run."""
    cache = ResponseCache(int(options.cache_mb * 1024 * 1024 / options.worker_count))
    metrics = ServerMetrics(cache, peers=peers)
    tracer = Tracer(options.otlp_endpoint) if options.otlp_endpoint else None

    def slot(uri: str, role: str = "primary") -> ModelSlot:
        version = registry.resolve(uri)  # fail fast: unknown models, missing ONNX artifacts, undeclared tasks
        runtime = load_runtime(registry, version, options.runtime, options.threads, options.precision)
        return ModelSlot(uri, registry, options, metrics, loaded=(version, runtime), role=role, tracer=tracer)

    slots = [slot(uri) for uri in uris]
    splits: dict[str, TrafficSplit] = {}
    shadow = None
    for flag in ("canary", "shadow"):
        value = getattr(options, flag)
        if value is None:
            continue
        uri, share = split_share(value, flag, required=flag == "canary")
        name = parse_uri(uri).name
        primary = next((s for s in slots if s.name == name), None)
        if primary is None:
            raise UsageError(f"--{flag} {uri}: no model named {name} is served; a {flag} is another version "
                             f"of a model served ({', '.join(sorted({s.name for s in slots}))})")
        extra = slot(uri, role=flag)
        if any(other.name == name and other.number == extra.number for other in slots):
            raise UsageError(f"--{flag} {uri} is version {extra.number} of {name}, which the server holds already: "
                             f"a {flag} is another version, to compare with the one served")
        slots.append(extra)
        if flag == "canary":
            splits[name] = TrafficSplit(primary, extra, share, route_hash_key(options.route_secret))
        else:
            shadow = Shadow(extra, share, options.shadow_queue)
    return ServerState(slots, metrics, cache, options, splits=splits, shadow=shadow, tracer=tracer, peers=peers,
                       start_grpc=start_grpc)


def bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """The server's socket, bound (not yet listening: no connection is accepted before the models are
    loaded) before anything else, so a port that is taken is one clear line and nothing is loaded."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return sock
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise MlscaleError(f"cannot serve on {host}:{port}: the port is already in use (another server?); "
                               f"choose another with {flag}") from None
        raise MlscaleError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def run_server(uris: list[str], options: ServeOptions, registry_location: str | None, sock: socket.socket, *,
               peers: Peers | None = None, log_level: str = "warning", announce: bool = False) -> None:
    """One server process on ``sock`` (bound; listening already when it is a worker's, inherited)."""
    try:
        if options.grpc_port is not None and peers is None:  # grpc binds its own socket later: check it can
            bind(options.host, options.grpc_port, flag="--grpc-port").close()
        # the gRPC service starts with the models, in the server's event loop (ServerState.start)
        state = build_state(uris, options, Registry(registry_location, create=False), peers=peers,
                            start_grpc=_start_grpc)
    except BaseException:
        sock.close()
        raise
    logging.basicConfig(level=logging.WARNING, format="mlscale serve: %(message)s")
    limit_client_fed_logs()  # a warning a request can cause: once an interval, with a count
    # No proxy-header rewriting (nothing here reads the client address) and no Server/Date headers:
    # per-request work the hot path does not need. What a client may hold is bounded: connections
    # (past --max-connections, 503), the time to send headers or a body (HeaderDeadline) and an idle
    # keep-alive.
    protocol = protocol_with(options.header_timeout_s, options.read_timeout_s, options.connection_limit,
                             state.metrics.refused["connections"].inc)
    config = uvicorn.Config(build_app(state), host=options.host, port=options.port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=30, lifespan="on", proxy_headers=False,
                            server_header=False, date_header=False, http=protocol,
                            timeout_keep_alive=options.keep_alive_s, backlog=2048)
    if announce:
        grpc_note = f", gRPC on {state.grpc_address}" if state.grpc_address else ""
        print(f"mlscale serve: {', '.join(uris)} on http://{options.host}:{options.port} (Open Inference Protocol "
              f"v2, /predict, /metrics{grpc_note})", file=sys.stderr, flush=True)
    _DrainingServer(config, state, options.drain_delay_s).run(sockets=[sock])
