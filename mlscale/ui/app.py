"""`mlscale ui`: a read-only web app (Starlette, served by uvicorn) over run directories, the registry and
live servers. One page (static HTML, JavaScript and the charting asset shipped in the package: nothing
fetched from elsewhere) and a JSON API it calls; a run in progress reaches the page as Server-Sent Events.

Only GET is routed: the UI changes nothing it shows. With a token (``--token`` or ``$MLSCALE_UI_TOKEN``;
required to listen beyond loopback) every request must carry it: ``Authorization: Bearer``, or the
cookie a first visit to ``/?token=...`` sets (HttpOnly, SameSite=Strict, named for the port, holding a value
derived from the token, never the token; the token leaves the address bar).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from mlscale.common.redact import redact_url
from mlscale.errors import MlscaleError, UsageError
from mlscale.ui.registry import RegistryView
from mlscale.ui.runs import RunCatalog
from mlscale.ui.serving import ServerBoard

STATIC = Path(__file__).parent / "static"
COOKIE = "mlscale_ui"
TOKEN_ENV = "MLSCALE_UI_TOKEN"
LIVE_POLL_S = 0.5  # how often a live run's records are looked at for new lines
MAX_POINTS = 4000
log = logging.getLogger("mlscale.ui")

# The page loads only what the package ships (no CDN, no inline script); charts draw on canvas.
SECURITY_HEADERS = {
    # (style attributes only: the charts' tooltips are HTML with inline styles; no inline <style> or script)
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "style-src-attr 'unsafe-inline'; script-src 'self'; connect-src 'self'; "
                               "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


@dataclass
class UiSettings:
    runs: Path | None = None
    registry: str | None = None
    servers: list[str] = field(default_factory=list)
    token: str | None = None
    slo_ms: float = 100.0


def json_response(data: Any, status: int = 200) -> Response:
    options = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS  # registry rows: keys and values as stored
    return Response(orjson.dumps(data, option=options, default=str), status, media_type="application/json")


def is_loopback(host: str) -> bool:
    """A name or address of this machine only: what the UI listens on without a token, and the only Host a
    request may name then."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cookie_for(token: str, port: int) -> tuple[str, str]:
    """The login cookie of the UI on ``port``: its name (per port: browsers send a host's cookies to
    every port of it) and a value derived from the token (a cookie that reaches another server on the
    same host gives it neither the token nor a key to another UI)."""
    value = hmac.new(token.encode(), f"mlscale-ui-cookie:{port}".encode(), hashlib.sha256).hexdigest()
    return f"{COOKIE}_{port}", value


def _host(request: Request) -> str:
    return urllib.parse.urlsplit("//" + request.headers.get("host", "")).hostname or ""


class TokenGate:
    """Every request carries the token (header or cookie) when one is set; ``/?token=`` sets the cookie
    (``Secure`` unless the page is on a loopback name, where browsers keep it over plain http)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        if not self.token:  # loopback, no token: only requests addressed to this machine's own names, so a
            # page elsewhere whose name a DNS rebinding points here cannot read the API
            if not is_loopback(_host(request)):
                return await PlainTextResponse("mlscale ui: address it as 127.0.0.1 or localhost", 421)(
                    scope, receive, send)
            return await self.app(scope, receive, send)
        name, value = cookie_for(self.token, (scope.get("server") or ("", 0))[1] or 0)
        given = request.query_params.get("token")
        if given is not None and scope["path"] == "/" and hmac.compare_digest(given.encode(), self.token.encode()):
            response = RedirectResponse("/", 303)
            secure = scope.get("scheme") == "https" or not is_loopback(_host(request))
            response.set_cookie(name, value, httponly=True, samesite="strict", path="/", secure=secure)
            return await response(scope, receive, send)
        header = request.headers.get("authorization", "")
        if header.startswith("Bearer "):
            allowed = hmac.compare_digest(header.removeprefix("Bearer ").strip().encode(), self.token.encode())
        else:
            allowed = hmac.compare_digest(request.cookies.get(name, "").encode(), value.encode())
        if not allowed:
            response = PlainTextResponse("mlscale ui: this address needs the UI's token: open /?token=TOKEN once "
                                         "(the token is in $MLSCALE_UI_TOKEN where the UI was started)", 401)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class Contained:
    """An error no handler expected answers 500 with one short line in the log (rate-limited), not a
    traceback per request: the files the UI reads are others' to write, so what they hold must not be
    able to flood the log either."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            log.warning("mlscale ui: %s failed: %s: %s", scope.get("path"), type(exc).__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "")
            if not started:
                await json_response({"error": "the UI could not answer this request"}, 500)(scope, receive, send)


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                present = {name.lower() for name, _ in message["headers"]}
                message["headers"] += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()
                                       if k.encode() not in present]
            await send(message)

        return await self.app(scope, receive, with_headers)


def _number(request: Request, name: str) -> float | None:
    """A query parameter as a finite number (None when absent or not one)."""
    raw = request.query_params.get(name)
    if raw in (None, "") or len(raw) > 32:
        return None
    try:
        number = float(raw)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def build_app(settings: UiSettings) -> Starlette:
    catalog = RunCatalog(settings.runs)
    registry = RegistryView(settings.registry, catalog.id_of) if settings.registry else None
    board = ServerBoard(settings.servers, settings.slo_ms)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def info(request: Request) -> Response:
        return json_response({"runs": str(settings.runs) if settings.runs else None,
                              "registry": redact_url(settings.registry) if settings.registry else None,
                              "servers": [w.shown for w in board.watches]})

    async def runs(request: Request) -> Response:
        return json_response(await asyncio.to_thread(catalog.summaries))

    def _view(request: Request) -> Any:
        view = catalog.view(request.query_params.get("id", ""))
        if view is None:
            raise LookupError(f"no run {request.query_params.get('id', '')!r} under {settings.runs}")
        return view

    async def run(request: Request) -> Response:
        return json_response(await asyncio.to_thread(lambda: _view(request).detail()))

    async def series(request: Request) -> Response:
        points = int(min(MAX_POINTS, max(10, _number(request, "points") or 600)))
        rank = request.query_params.get("rank", "all")
        return json_response(await asyncio.to_thread(
            lambda: _view(request).series_payload(_number(request, "from"), _number(request, "to"), points, rank)))

    async def live(request: Request) -> Response:
        view = _view(request)
        after = _number(request, "after") or 0.0
        start = int(after) if math.isfinite(after) and after > 0 else 0

        async def stream() -> AsyncIterator[bytes]:
            sent = start
            yield b"retry: 2000\n\n"
            while not await request.is_disconnected():
                await asyncio.to_thread(view.refresh)
                total, rows = await asyncio.to_thread(view.rows, sent)  # at most LIVE_ROWS: memory bounded
                if total < sent:  # the records were read again from the start (a resumed run)
                    yield b"event: reset\ndata: {}\n\n"
                    sent = 0
                    continue
                if rows:
                    sent += len(rows)
                    yield b"event: rows\ndata: " + orjson.dumps(rows) + b"\n\n"
                    if sent < total:
                        continue  # more to catch up on: the next rows at once
                else:
                    yield b": idle\n\n"
                await asyncio.sleep(LIVE_POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    async def registry_models(request: Request) -> Response:
        if registry is None:
            return json_response({"configured": False, "models": []})
        return json_response({"configured": True, "location": redact_url(settings.registry or ""),
                              "models": await asyncio.to_thread(registry.models)})

    async def registry_model(request: Request) -> Response:
        if registry is None:
            return json_response({"error": "no --registry given"}, 404)
        name = request.query_params.get("name", "")
        return json_response(await asyncio.to_thread(registry.model, name))

    async def servers(request: Request) -> Response:
        return json_response(await asyncio.to_thread(board.poll))

    async def not_found(request: Request, exc: Exception) -> Response:
        return json_response({"error": str(exc)}, 404)

    async def refused(request: Request, exc: Exception) -> Response:
        return json_response({"error": str(exc)}, 404 if isinstance(exc, UsageError) else 500)

    routes = [
        Route("/", index), Route("/api/info", info), Route("/api/runs", runs), Route("/api/run", run),
        Route("/api/series", series), Route("/api/live", live), Route("/api/registry", registry_models),
        Route("/api/registry/model", registry_model), Route("/api/servers", servers),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={LookupError: not_found, MlscaleError: refused},
                    middleware=[Middleware(Contained), Middleware(SecurityHeaders),
                                Middleware(TokenGate, token=settings.token)])
    app.state.catalog = catalog
    return app
