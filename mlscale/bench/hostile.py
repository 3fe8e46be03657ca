"""`mlscale bench hostile`: what cheap attacks cost a server. For each attack, a normal client on its
own connection keeps sending a valid request while the attack runs; we record its latency (p50, p99,
worst), its errors, the server's resident memory (peak, above its idle size) and how soon after the
attack stops the normal client is answered again.

The attacks are those a reviewer tried by hand: sockets that send headers one line at a time, bodies
that never finish, idle connections, a flood of almost-complete 8 MB bodies, 8 MB JSON bodies of
``[0],[0],...`` to decode, and gRPC calls whose message never comes. Every one runs on 127.0.0.1 only,
for a bounded time, with a bounded number of sockets, and stops by itself.

The normal client is closed-loop with pacing (one request every ``interval_s``, from a thread of this
process, over one keep-alive connection): it measures what a client sees, not the server's capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Target:
    """The server under attack: where it listens and a valid request for the normal client."""

    port: int
    body: bytes
    path: str = "/v2/models/digits/infer"
    host: str = "127.0.0.1"
    grpc_address: str | None = None
    pid: int | None = None  # the server's process, for its memory
    method: str = "POST"  # the normal client's request (GET: no body)


def _headers(target: Target, length: int, extra: str = "") -> bytes:
    return (f"POST {target.path} HTTP/1.1\r\nhost: {target.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n{extra}\r\n").encode()


async def _open(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        return await asyncio.wait_for(asyncio.open_connection(target.host, target.port), 2)
    except (OSError, asyncio.TimeoutError):
        return None


async def _closed_by_server(reader: asyncio.StreamReader, seconds: float) -> tuple[bool, bytes]:
    """(the server closed the connection within ``seconds``, what it sent first)."""
    try:
        first = await asyncio.wait_for(reader.read(64), seconds)
        if not first:
            return True, b""
        rest = await asyncio.wait_for(reader.read(), seconds)
        return True, first + rest
    except asyncio.TimeoutError:
        return False, b""
    except OSError:  # reset by the server (it closed with unread bytes of ours in its buffer)
        return True, b""


def _close_all(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        with contextlib.suppress(Exception):
            writer.close()


async def _hold(target: Target, seconds: float, clients: int,
                begin: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> dict[str, Any]:
    """``clients`` connections, each started by ``begin`` and then held for ``seconds``: how many the
    server closed, and how many it answered 408."""
    opened = [c for c in await asyncio.gather(*(_open(target) for _ in range(clients))) if c is not None]
    writers = [w for _, w in opened]

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[bool, bytes]:
        try:
            await begin(writer)
        except OSError:
            return True, b""
        return await _closed_by_server(reader, seconds)

    try:
        results = await asyncio.gather(*(one(r, w) for r, w in opened))
    finally:
        _close_all(writers)
    return {"clients": clients, "connected": len(opened), "closed_by_server": sum(c for c, _ in results),
            "answered_408": sum(first.startswith(b"HTTP/1.1 408") for _, first in results),
            "answered_431": sum(first.startswith(b"HTTP/1.1 431") for _, first in results)}


async def slow_headers(target: Target, seconds: float, clients: int = 50, every_s: float = 1.0) -> dict[str, Any]:
    """Each connection sends its request line, then one header line every ``every_s`` (slowloris)."""
    async def begin(writer: asyncio.StreamWriter) -> None:
        writer.write(f"POST {target.path} HTTP/1.1\r\n".encode())
        await writer.drain()
        asyncio.get_running_loop().create_task(_trickle(writer, seconds, every_s))

    return await _hold(target, seconds, clients, begin)


async def _trickle(writer: asyncio.StreamWriter, seconds: float, every_s: float) -> None:
    end = time.monotonic() + seconds
    with contextlib.suppress(Exception):
        while time.monotonic() < end and not writer.is_closing():
            await asyncio.sleep(every_s)
            writer.write(b"x-slow: 1\r\n")
            await writer.drain()


async def slow_bodies(target: Target, seconds: float, clients: int = 256) -> dict[str, Any]:
    """Each connection sends whole headers and one byte of a 2,000-byte body, then nothing."""
    async def begin(writer: asyncio.StreamWriter) -> None:
        writer.write(_headers(target, 2000) + b"{")
        await writer.drain()

    return await _hold(target, seconds, clients, begin)


async def big_headers(target: Target, seconds: float, clients: int = 4, size: int = 48_000_000) -> dict[str, Any]:
    """Each connection sends a request whose one header is ``size`` bytes (48 MB: what stalled the
    server's health probes for 2 s while its parser took it whole), as fast as the server reads."""
    chunk = b"a" * 65536

    async def begin(writer: asyncio.StreamWriter) -> None:
        writer.write(f"GET /v2/health/ready HTTP/1.1\r\nhost: {target.host}\r\nx-big: ".encode())
        sent = 0
        with contextlib.suppress(OSError):
            while sent < size and not writer.is_closing():
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()

    details = await _hold(target, seconds, clients, begin)
    return details


async def idle_connections(target: Target, seconds: float, clients: int = 400) -> dict[str, Any]:
    """Connections that never send a byte."""
    async def begin(writer: asyncio.StreamWriter) -> None:
        return None

    return await _hold(target, seconds, clients, begin)


async def body_flood(target: Target, seconds: float, clients: int = 40, size: int = 8_000_000) -> dict[str, Any]:
    """Each connection declares an 8 MB body and sends all of it but the last byte."""
    chunk = b"0" * 65536

    async def begin(writer: asyncio.StreamWriter) -> None:
        writer.write(_headers(target, size))
        sent = 0
        while sent < size - 1:
            part = chunk[: min(len(chunk), size - 1 - sent)]
            writer.write(part)
            sent += len(part)
            await asyncio.wait_for(writer.drain(), seconds)  # a server that stops reading ends the flood

    async def guarded(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await begin(writer)

    return await _hold(target, seconds, clients, guarded)


def nested_zeros_body(size: int = 8_000_000) -> bytes:
    """An infer request whose data is ``[0],[0],...``: about ``size`` bytes of lists to decode."""
    head = b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":['
    count = (size - len(head) - 4) // 4
    return head + b",".join([b"[0]"] * count) + b"]}]}"


async def big_decodes(target: Target, seconds: float, clients: int = 3) -> dict[str, Any]:
    """Each client sends 8 MB JSON bodies of ``[0],[0],...`` one after another, reading each answer."""
    body = nested_zeros_body()
    statuses: dict[str, int] = {}

    async def one() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            opened = await _open(target)
            if opened is None:
                statuses["refused"] = statuses.get("refused", 0) + 1
                await asyncio.sleep(0.1)
                continue
            reader, writer = opened
            try:
                writer.write(_headers(target, len(body), "connection: close\r\n") + body)
                await asyncio.wait_for(writer.drain(), seconds)
                line = await asyncio.wait_for(reader.readline(), seconds)
                code = line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "none"
                statuses[code] = statuses.get(code, 0) + 1
            except (OSError, asyncio.TimeoutError):
                statuses["error"] = statuses.get("error", 0) + 1
            finally:
                _close_all([writer])

    await asyncio.gather(*(one() for _ in range(clients)))
    return {"clients": clients, "answers": statuses}


async def grpc_unfinished(target: Target, seconds: float, calls: int = 50) -> dict[str, Any]:
    """gRPC inference calls opened as streams whose request message never comes."""
    import grpc

    assert target.grpc_address is not None, "the server has no gRPC port"
    never = asyncio.Event()

    async def no_message():  # type: ignore[no-untyped-def]
        await never.wait()
        yield b""

    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        method = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                      request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        pending = [method(no_message()) for _ in range(calls)]
        await asyncio.sleep(seconds)
        for call in pending:
            call.cancel()
    return {"calls": calls}


def _entity_requests(target: Target, seconds: float) -> dict[str, Any]:
    """Requests to the model served from features (``churn``) for ``seconds``: their statuses and p99."""
    body = json.dumps({"parameters": {"entities": [{"user_id": 3}]}}).encode()
    statuses: dict[str, int] = {}
    latencies = []
    end = time.monotonic() + seconds
    connection = None
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            connection = connection or http.client.HTTPConnection(target.host, target.port, timeout=30)
            connection.request("POST", "/v2/models/churn/infer", body, {"content-type": "application/json"})
            response = connection.getresponse()
            response.read()
            code = str(response.status)
        except (OSError, http.client.HTTPException):
            code, connection = "error", None
        latencies.append(time.perf_counter() - start)
        statuses[code] = statuses.get(code, 0) + 1
        time.sleep(0.02)
    return {"feature_requests": statuses, "feature_p99_ms": _ms(np.percentile(latencies, 99)) if latencies else None}


async def locked_feature_log(target: Target, seconds: float, log_path: str = "") -> dict[str, Any]:
    """Another process holds the feature log's write lock while the model served from features is asked."""
    await asyncio.to_thread(_entity_requests, target, 0.5)  # the log exists once a vector was written
    await asyncio.sleep(0.5)
    locker = sqlite3.connect(log_path, timeout=5)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        return await asyncio.to_thread(_entity_requests, target, seconds)
    finally:
        locker.rollback()
        locker.close()


async def silent_store(target: Target, seconds: float) -> dict[str, Any]:
    """The online store is a Redis that accepts connections and never answers (the server was started
    with it): the model served from features is asked meanwhile."""
    return await asyncio.to_thread(_entity_requests, target, seconds)


ATTACKS: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
    "slow_headers": slow_headers, "slow_bodies": slow_bodies, "idle_connections": idle_connections,
    "big_headers": big_headers,
    "body_flood": body_flood, "big_decodes": big_decodes, "grpc_unfinished": grpc_unfinished,
    "locked_feature_log": locked_feature_log, "silent_redis": silent_store,
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Probe:
    """The normal client: a valid request every ``interval_s`` over one keep-alive connection (a new one
    after an error), in a thread; latencies in seconds, statuses, and when each answer came."""

    target: Target
    interval_s: float = 0.02
    latencies: list[float] = field(default_factory=list)
    answers: list[tuple[float, int]] = field(default_factory=list)  # (time answered, status; 0: no answer)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        connection = None
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                connection = connection or http.client.HTTPConnection(self.target.host, self.target.port, timeout=10)
                if self.target.method == "GET":
                    connection.request("GET", self.target.path)
                else:
                    connection.request("POST", self.target.path, self.target.body,
                                       {"content-type": "application/json"})
                response = connection.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException):
                status, connection = 0, None
            now = time.perf_counter()
            self.latencies.append(now - start)
            self.answers.append((now, status))
            self._stop.wait(max(0.0, self.interval_s - (now - start)))

    def stop(self) -> None:
        self._stop.set()


def measure(target: Target, attack: str, seconds: float = 3.0, recovery_s: float = 1.0,
            runner: Callable[..., Awaitable[dict[str, Any]]] | None = None, **options: Any) -> dict[str, Any]:
    """Run ``attack`` (``runner``, else the attack of that name) for ``seconds`` with the normal client on:
    its latency and errors during the attack, the server's memory, and how long after the attack the
    normal client's next 200 came."""
    probe = Probe(target)
    idle_rss = rss_mb(target.pid) if target.pid else None
    peak = [idle_rss or 0.0]
    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.wait(0.05):
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], rss_mb(target.pid))  # type: ignore[arg-type]

    threads = [threading.Thread(target=probe.run, daemon=True)]
    if target.pid:
        threads.append(threading.Thread(target=sample_rss, daemon=True))
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    details = asyncio.run(asyncio.wait_for((runner or ATTACKS[attack])(target, seconds, **options), seconds + 30))
    ended = time.perf_counter()
    time.sleep(recovery_s)
    probe.stop()
    sampling.set()
    for thread in threads:
        thread.join(15)
    during = [lat for lat, (at, _) in zip(probe.latencies, probe.answers) if began <= at - lat and at <= ended + 10]
    statuses = [status for at, status in probe.answers if began <= at <= ended]
    after = [at - ended for at, status in probe.answers if at > ended and status == 200]
    return {
        "attack": attack, "seconds": round(ended - began, 2), "details": details,
        "client_requests": len(during), "client_errors": sum(s != 200 for s in statuses),
        "client_p50_ms": _ms(np.percentile(during, 50)) if during else None,
        "client_p99_ms": _ms(np.percentile(during, 99)) if during else None,
        "client_worst_ms": _ms(max(during)) if during else None,
        "rss_idle_mb": round(idle_rss, 1) if idle_rss else None,
        "rss_peak_mb": round(peak[0], 1) if target.pid else None,
        "answered_again_after_ms": _ms(after[0]) if after else None,
        "held_at_end": (details["connected"] - details["closed_by_server"]) if "connected" in details else None,
    }


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 1)
