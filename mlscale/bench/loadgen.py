"""An open-loop load generator: Poisson arrivals, latency measured from the intended send time.

Requests are scheduled in advance (exponential gaps at the offered rate) and sent when due, whether
or not earlier ones have been answered, so a slow server cannot slow the offered load down
(no coordinated omission). Latency = completion - intended send time. The generator's own lag (actual
- intended send time) is reported; a run whose generator lagged is not a valid measurement of the
server. Minimal HTTP/1.1 over persistent connections keeps the client cheap.

Run as ``python -m mlscale.bench.loadgen`` with the JSON config on standard input (or as the one
argument); prints a JSON result.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any


def _request_bytes(host: str, path: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, chunked = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def generate(config: dict[str, Any]) -> dict[str, Any]:
    host, port, path = config["host"], config["port"], config["path"]
    rate, duration, warmup = config["rate"], config["duration_s"], config["warmup_s"]
    requests = [_request_bytes(host, path, body.encode()) for body in config["bodies"]]
    rng = random.Random(config.get("seed", 0))
    offsets, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= warmup + duration:
            break
        offsets.append(t)
    loop = asyncio.get_running_loop()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(config.get("connections", 32)):
        idle.append(await asyncio.open_connection(host, port))
    records: list[tuple[float, float, float, int]] = []
    timeout = config.get("timeout_s", 10.0)

    async def one(index: int, intended: float) -> None:
        sent = loop.time()
        try:
            reader, writer = idle.pop() if idle else await asyncio.open_connection(host, port)
            sent = loop.time()
            writer.write(requests[index % len(requests)])
            status = await asyncio.wait_for(_read_response(reader), timeout)
            idle.append((reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status = 0
        records.append((intended, sent, loop.time(), status))

    start = loop.time() + 0.05
    tasks = []
    for index, offset in enumerate(offsets):
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index, start + offset)))
    await asyncio.gather(*tasks)
    measured = [r for r in records if r[0] >= start + warmup]
    ok = [r for r in measured if r[3] == 200]
    latencies = [(r[2] - r[0]) * 1e3 for r in ok]
    lags = [(r[1] - r[0]) * 1e3 for r in measured]
    statuses: dict[str, int] = {}
    for r in measured:
        statuses[str(r[3])] = statuses.get(str(r[3]), 0) + 1
    return {
        "offered_rate": rate, "requests": len(measured), "ok": len(ok), "statuses": statuses,
        "error_rate": 1 - len(ok) / len(measured) if measured else 1.0,
        "throughput": len(ok) / duration,
        "latency_ms": {"p50": _percentile(latencies, 0.5), "p90": _percentile(latencies, 0.9),
                       "p99": _percentile(latencies, 0.99), "max": max(latencies, default=float("nan"))},
        "generator_lag_ms": {"p50": _percentile(lags, 0.5), "p99": _percentile(lags, 0.99)},
    }


def main() -> None:
    config = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    if config.get("cpu") is not None:
        import os

        os.sched_setaffinity(0, {config["cpu"]})
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    started = time.time()
    result = asyncio.run(generate(config))
    result["wall_s"] = time.time() - started
    print(json.dumps(result))


if __name__ == "__main__":
    main()
