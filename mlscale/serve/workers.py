"""A server of several worker processes (``mlscale serve --workers N``): one supervisor, N workers.

How requests reach a worker: the supervisor binds the HTTP port once; every worker inherits that one
socket (it listens from when the first worker has loaded its models) and accepts from it (the kernel
hands each new connection to a worker waiting in ``accept``, so an idle worker takes more of them than
a busy one). A keep-alive
connection stays with the worker that accepted it. The gRPC port is bound by every worker with
``SO_REUSEPORT`` (the kernel spreads connections over them). Each worker holds its own copy of the
models, batchers and response cache (the cache's bound divided among them), so batches form per
worker from the requests its connections carry.

What the workers share lives in a private folder the supervisor makes (``Peers``): a byte per worker,
1 while it is ready (readiness is ready only when every byte is), and each worker's metrics,
published every ``PUBLISH_S`` and merged by whichever worker is scraped (``/metrics`` and the
statistics calls speak for the whole server; a dead worker's counters are kept, so no counter ever
goes back).

A worker that dies is restarted (counted: ``mlscale_worker_restarts``); the requests it held are
lost with it, the others never reached it (they wait in the shared socket's backlog or go to the
other workers). SIGTERM to the supervisor is passed to every worker, each drains as one server does,
and the supervisor exits 0 once all have. Workers run in a session of their own (a terminal's Ctrl-C
reaches the supervisor only, which passes it on once) and die with the supervisor (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlscale.errors import MlscaleError
from mlscale.serve.options import ServeOptions, usable_cores

log = logging.getLogger("mlscale.serve")
PUBLISH_S = 0.5  # how often a worker publishes its metrics for the others
BACKLOG = 2048
GIVE_UP_AFTER = 5  # workers in a row that die before ever being ready: the supervisor stops


class Peers:
    """The folder the workers of one server share: ready bytes and published metrics."""

    def __init__(self, directory: str | Path, count: int, index: int | None = None) -> None:
        self.directory, self.count, self.index = Path(directory), count, index
        flags = self.directory / "flags.bin"  # a byte per worker: 1 while it is ready
        if not flags.exists():
            flags.write_bytes(bytes(count))
        self._file = flags.open("r+b")
        self.flags = mmap.mmap(self._file.fileno(), count)

    def set_ready(self, ready: bool) -> None:
        assert self.index is not None
        self.flags[self.index] = 1 if ready else 0

    def all_ready(self) -> bool:
        return self.flags[:self.count] == b"\x01" * self.count

    def ready_count(self) -> int:
        return self.flags[:self.count].count(1)

    # -- metrics -------------------------------------------------------------------------------
    def _published(self, index: int) -> Path:
        return self.directory / f"metrics-{index}.json"

    def publish(self, snapshot: dict[str, Any]) -> None:
        """This worker's snapshot, replaced whole (a reader never sees half of one)."""
        target = self._published(self.index or 0)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(json.dumps(snapshot).encode())
        os.replace(partial, target)

    def retire(self, index: int, generation: int) -> None:
        """A dead worker's last snapshot: its counters count for ever, its gauges no more."""
        with contextlib.suppress(FileNotFoundError):
            os.replace(self._published(index), self.directory / f"retired-{index}-{generation}.json")

    def snapshots(self, own: dict[str, Any]) -> list[tuple[str | None, dict[str, Any], bool]]:
        """(worker label, snapshot, live) of every worker: this one's ``own``, the others' last published,
        and those of dead workers (not live)."""
        found: list[tuple[str | None, dict[str, Any], bool]] = [(str(self.index), own, True)]
        paths = sorted(self.directory.glob("*.json"))
        seen = set(paths)
        for path in paths:
            live = path.name.startswith("metrics-")
            if (live and path == self._published(self.index or 0)) or not (live or path.name.startswith("retired-")):
                continue
            worker = path.stem.split("-")[1]
            try:
                found.append((worker, json.loads(path.read_bytes()), live))
            except (FileNotFoundError, ValueError):
                if live:  # retired since the listing: read it under its new name, its counts must not drop
                    for retired in sorted(set(self.directory.glob(f"retired-{worker}-*.json")) - seen):
                        with contextlib.suppress(FileNotFoundError, ValueError):
                            found.append((worker, json.loads(retired.read_bytes()), False))
        return found

    def extra(self) -> list[Metric]:
        """The supervisor's own series: workers and restarts."""
        restarts = 0
        with contextlib.suppress(FileNotFoundError, ValueError):
            restarts = json.loads((self.directory / "supervisor.json").read_bytes())["restarts"]
        workers = GaugeMetricFamily("mlscale_workers", "Worker processes of this server, and how many are ready",
                                    labels=["state"])
        workers.add_metric(["configured"], self.count)
        workers.add_metric(["ready"], self.ready_count())
        return [workers, CounterMetricFamily("mlscale_worker_restarts", "Workers that died and were restarted",
                                             value=restarts)]

    def close(self) -> None:
        self.flags.close()
        self._file.close()


# -- the supervisor --------------------------------------------------------------------------------
class Supervisor:
    def __init__(self, uris: list[str], options: ServeOptions, registry_location: str | None,
                 sock: socket.socket) -> None:
        self.uris, self.options, self.registry_location, self.sock = uris, options, registry_location, sock
        self.count = options.worker_count
        self.directory = Path(tempfile.mkdtemp(prefix="mlscale-serve-"))  # private: 0700
        self.peers = Peers(self.directory, self.count)
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * self.count
        self.generations = [0] * self.count
        self.restarts = 0
        self.failed_starts = 0  # workers in a row that died before they were ready
        self.was_ready = [False] * self.count
        self.stopping: int | None = None  # the signal being passed on

    def spec(self, index: int) -> dict[str, Any]:
        options = self.options.model_dump(mode="json")
        options["workers"] = self.count
        return {"uris": self.uris, "options": options, "registry": self.registry_location, "index": index,
                "directory": str(self.directory), "fd": self.sock.fileno()}

    def spawn(self, index: int) -> None:
        threads = str(self.options.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "OPENBLAS_NUM_THREADS": threads}
        process = subprocess.Popen([sys.executable, "-m", "mlscale.serve.workers"], stdin=subprocess.PIPE,
                                   pass_fds=(self.sock.fileno(),), env=env, start_new_session=True)
        assert process.stdin is not None
        process.stdin.write(json.dumps(self.spec(index)).encode())  # no secret on a command line
        process.stdin.close()
        self.processes[index] = process
        self.was_ready[index] = False
        if self.stopping is not None:  # a signal came while it was being started: it stops too
            process.send_signal(self.stopping)

    def signal_all(self, sig: int) -> None:
        for process in self.processes:
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def on_signal(self, sig: int, _: Any) -> None:
        self.stopping = sig
        self.signal_all(sig)  # a second signal passed on too: the workers exit at once

    def run(self) -> int:
        for index in range(self.count):
            self.spawn(index)
        previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        announced = False
        try:
            while True:
                time.sleep(0.05)
                if not announced and self.peers.all_ready():
                    announced = True
                    print(f"mlscale serve: {self.count} workers ready", file=sys.stderr, flush=True)
                for index in range(self.count):
                    self.was_ready[index] = self.was_ready[index] or bool(self.peers.flags[index])
                code = self.reap(announced)
                if code is not None:
                    return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.signal_all(signal.SIGKILL)
            self.peers.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def reap(self, started: bool) -> int | None:
        """Restart workers that died; an exit code once the server is done (all exited after a signal,
        or a worker failed to start)."""
        if self.stopping is not None:
            codes = [process.poll() for process in self.processes if process is not None]
            if all(code is not None for code in codes):
                return max((code for code in codes if code is not None and code > 0), default=0)
            return None
        for index, process in enumerate(self.processes):
            code = process.poll() if process is not None else None
            if code is None:
                continue
            self.peers.flags[index] = 0
            self.peers.retire(index, self.generations[index])
            self.generations[index] += 1
            if not started and not self.was_ready[index]:  # a bad model, a taken port: stop, say why (it did)
                self.stopping = signal.SIGTERM
                self.signal_all(signal.SIGKILL)
                return code if code > 0 else 1
            self.failed_starts = 0 if self.was_ready[index] else self.failed_starts + 1
            if self.failed_starts >= GIVE_UP_AFTER:
                log.error("%d workers in a row died before they were ready: stopping", self.failed_starts)
                self.stopping = signal.SIGTERM
                self.signal_all(signal.SIGTERM)
                return 1
            if self.stopping is not None:  # a signal came meanwhile: no restart
                continue
            self.restarts += 1
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            log.warning("worker %d (pid %d) died (%s): restarted (%d restarts)", index, process.pid, how,
                        self.restarts)
            partial = self.directory / "supervisor.partial"
            partial.write_text(json.dumps({"restarts": self.restarts}))
            os.replace(partial, self.directory / "supervisor.json")  # never read half written
            self.spawn(index)
        return None


def supervise(uris: list[str], options: ServeOptions, registry_location: str | None) -> int:
    """Serve with ``options.worker_count`` processes (see the module's docstring); the exit code."""
    from mlscale.registry import Registry
    from mlscale.serve.server import bind, model_uris

    count = options.worker_count
    cores = usable_cores()
    busy = count * options.instances * options.threads
    if busy > cores:
        log.warning("%d workers x %d instances x %d threads = %d threads for %d cores: they will share them",
                    count, options.instances, options.threads, busy, cores)
    sock = bind(options.host, options.port)
    try:
        if options.grpc_port is not None:
            bind(options.host, options.grpc_port, flag="--grpc-port").close()
        registry = Registry(registry_location, create=False)
        for uri in model_uris(uris, options):  # an unknown model is one line before any worker starts
            registry.resolve(uri)
        sock.set_inheritable(True)  # listening once the first worker has loaded the models (uvicorn listens)
    except BaseException:
        sock.close()
        raise
    grpc_note = f", gRPC on port {options.grpc_port}" if options.grpc_port else ""
    print(f"mlscale serve: {', '.join(uris)} on http://{options.host}:{options.port} with {count} workers "
          f"(Open Inference Protocol v2, /predict, /metrics{grpc_note})", file=sys.stderr, flush=True)
    try:
        return Supervisor(uris, options, registry_location, sock).run()
    finally:
        sock.close()


# -- a worker --------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the supervisor goes, however it goes."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main() -> int:
    """One worker: the spec from standard input, the listening socket inherited, then a server as
    ``mlscale serve`` runs one."""
    _die_with_parent()
    spec = json.loads(sys.stdin.buffer.read())
    options = ServeOptions(**spec["options"])
    from mlscale.errors import report_error
    from mlscale.serve import batcher
    from mlscale.serve.server import run_server

    # each worker has about a core of its own: as on a one-core host, small batches run on the event loop
    batcher.ONE_CORE = batcher.ONE_CORE or options.worker_count >= usable_cores()
    sock = socket.socket(fileno=spec["fd"])
    peers = Peers(spec["directory"], options.worker_count, spec["index"])
    try:
        run_server(spec["uris"], options, spec["registry"], sock, peers=peers)
    except MlscaleError as exc:
        return report_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
