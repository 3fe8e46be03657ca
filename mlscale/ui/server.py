"""Checking what ``mlscale ui`` was given, then serving the app (uvicorn on a socket bound here, so a port
in use is one line, not a traceback)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from pathlib import Path

import uvicorn

from mlscale.common.connections import open_file_connection_limit, protocol_with
from mlscale.common.log_limits import limit_client_fed_logs
from mlscale.common.redact import redact_url
from mlscale.errors import MlscaleError, UsageError
from mlscale.registry import Registry
from mlscale.ui.app import TOKEN_ENV, UiSettings, build_app, is_loopback
from mlscale.ui.runs import RunCatalog

DEFAULT_RUNS = "runs"
HEADER_TIMEOUT_S = 5.0  # a connection's request headers arrive within this, or it is closed


def settings_from(runs: str | None, registry: str | None, servers: list[str], host: str, port: int,
                  token: str | None, slo_ms: float = 100.0) -> tuple[UiSettings, str, int]:
    """The settings, each checked with one line naming what is wrong (exit 2)."""
    token = token or os.environ.get(TOKEN_ENV) or None
    if not is_loopback(host) and not token:
        raise UsageError(f"bad value host={host!r}: beyond loopback the UI needs a token (--token, or "
                         f"${TOKEN_ENV}): it would show your runs, registry and servers to anyone who can reach "
                         f"the port; or keep it on 127.0.0.1 and forward the port (ssh -L, kubectl port-forward)")
    if token is not None and len(token) < 16:
        raise UsageError("bad value token: at least 16 characters (openssl rand -hex 16 makes one)")
    if not 0 <= port <= 65535:
        raise UsageError(f"bad value port={port}: 0 to 65535")
    if slo_ms <= 0:
        raise UsageError(f"bad value slo_ms={slo_ms:g}: must be above 0")
    root = Path(runs or DEFAULT_RUNS)
    if runs is not None and not root.is_dir():
        raise UsageError(f"bad value runs={runs!r}: no such folder")
    registry = registry or os.environ.get("MLSCALE_REGISTRY")
    if registry is None and Path("mlscale-registry", "registry.db").exists():
        registry = "mlscale-registry"
    if registry is not None:
        Registry(registry, create=False)  # an error now, not on the page: no such registry, unreachable
    for url in servers:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"bad value server={redact_url(url)!r}: an http:// or https:// address of a server")
    return UiSettings(runs=root if root.is_dir() else None, registry=registry, servers=list(servers), token=token,
                      slo_ms=slo_ms), host, port


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise MlscaleError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _read_ahead(catalog: RunCatalog) -> None:
    """The recent runs' records, read while the user opens the page; a run that cannot be read now is
    read (and its error shown) when its page asks."""
    with contextlib.suppress(Exception):
        catalog.read_ahead()


def run_ui(settings: UiSettings, host: str, port: int) -> int:
    """Serve until interrupted; the address (never the token) is printed once listening."""
    sock = bind(host, port)
    shown_host = f"[{host}]" if ":" in host else host
    address = f"http://{shown_host}:{sock.getsockname()[1]}/"
    registry = redact_url(settings.registry) if settings.registry else "none"
    where = [f"runs: {settings.runs or 'none'}", f"registry: {registry}", f"servers: {len(settings.servers)}"]
    login = f" (open {address}?token=... with the token of ${TOKEN_ENV} or --token once)" if settings.token else ""
    print(f"mlscale ui: {address}{login}  [{', '.join(where)}]", file=sys.stderr, flush=True)
    app = build_app(settings)
    threading.Thread(target=_read_ahead, args=(app.state.catalog,), daemon=True, name="read-ahead").start()
    limit_client_fed_logs()
    # What a client may hold, as `mlscale serve` bounds it: open connections (past the cap, 503), the time
    # to send headers, their size (431); the UI takes no body.
    protocol = protocol_with(HEADER_TIMEOUT_S, HEADER_TIMEOUT_S, open_file_connection_limit(512))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=2,
                            http=protocol, server_header=False, proxy_headers=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
