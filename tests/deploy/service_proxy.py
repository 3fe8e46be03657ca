"""A stand-in for a Kubernetes Service in front of local replicas: what kube-proxy does, in small.

Connections (not requests) are spread round robin over the replicas in rotation, and bytes are
copied both ways; a replica enters the rotation when its readiness probe passes and leaves it after
``failures`` probes in a row fail (probed every ``period_s``, as the kubelet does with the manifest's
readinessProbe).
Like kube-proxy, leaving the rotation does not cut a connection already made to that replica, and
nothing is retried: a request that fails reaches the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from dataclasses import dataclass


@dataclass
class Replica:
    name: str
    port: int
    ready: bool = False
    failed: int = 0  # probes failed in a row


class ServiceProxy:
    def __init__(self, probe_path: str, period_s: float, timeout_s: float, failures: int) -> None:
        self.probe_path, self.period_s, self.timeout_s, self.failures = probe_path, period_s, timeout_s, failures
        self.replicas: list[Replica] = []
        self.connections: Counter[str] = Counter()  # replica name -> connections routed to it
        self.refused = 0  # connections that found no replica in rotation, or whose replica refused them
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> ServiceProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self._prober = asyncio.run_coroutine_threadsafe(self._probe_forever(), self._loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self._prober.cancel()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._route, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    def add(self, name: str, port: int) -> None:
        """A new pod's endpoint: in rotation once its readiness probe passes."""
        self._loop.call_soon_threadsafe(self.replicas.append, Replica(name, port))

    def in_rotation(self) -> list[str]:
        return [r.name for r in self.replicas if r.ready]

    def _pick(self) -> Replica | None:
        ready = [r for r in self.replicas if r.ready]
        if not ready:
            return None
        self._next += 1
        return ready[self._next % len(ready)]

    async def _route(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        replica = self._pick()
        try:
            if replica is None:
                raise ConnectionRefusedError
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", replica.port)
        except OSError:
            self.refused += 1
            client_writer.close()
            return
        self.connections[replica.name] += 1
        await asyncio.gather(self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _probe_forever(self) -> None:
        while True:
            for replica in list(self.replicas):
                if await self._probe(replica.port):
                    replica.ready, replica.failed = True, 0
                else:
                    replica.failed += 1
                    replica.ready = replica.ready and replica.failed < self.failures
            await asyncio.sleep(self.period_s)

    async def _probe(self, port: int) -> bool:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), self.timeout_s)
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(f"GET {self.probe_path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode())
            status = await asyncio.wait_for(reader.readline(), self.timeout_s)
            return status.split()[1:2] == [b"200"]
        except (OSError, TimeoutError, IndexError):
            return False
        finally:
            writer.close()
